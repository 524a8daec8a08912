"""The OpenAI-compatible HTTP server (aiohttp): completions, chat, SSE streaming, health, metrics.

Every error is an OpenAI-style JSON body with a fitting status; a bad request never disturbs
the others. A client that goes away aborts its request, which frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import signal
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any

from aiohttp import web
from pydantic import BaseModel, ValidationError

from superinfer.engine import contract as c
from superinfer.engine.config import EngineConfig
from superinfer.engine.core.request import SamplingParams
from superinfer.engine.engine import AsyncEngine, EngineCore, EngineDeadError
from superinfer.engine.gc_freeze import freeze_startup_heap
from superinfer.engine.output import RequestOutput
from superinfer.engine.output_constraint import GrammarError, GuidedSpec
from superinfer.engine.process import CoreView, ProcessEngine
from superinfer.engine.serving.completion_bodies import ChatFormat, ChoiceSpec, CompletionFormat
from superinfer.engine.serving.request_models import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    for_choice,
)
from superinfer.engine.serving.responses_output import ResponsesFormat, sse_event
from superinfer.engine.serving.responses_request import RESPONSES_PARAMS, ResponsesRequest
from superinfer.engine.serving.tool_parsers import ToolParser, detect_parser, get_parser
from superinfer.engine.slo import SLO
from superinfer.engine.slo_classes import resolve
from superinfer.engine.tokenizer import Tokenizer

log = logging.getLogger("superinfer.server")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


# The union members pydantic puts in error locations ('str', 'list[int]', 'TextPart'): no field
# of the API is named like one.
_UNION_MEMBER = re.compile(r"^([a-z]+\[.*\]|str|int|float|bool|dict|list|[A-Z]\w*)$")


def _field_path(loc: tuple) -> str:
    """An error location as the request names it, without union members."""
    return ".".join(str(p) for p in loc if not (isinstance(p, str) and _UNION_MEMBER.match(p)))


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


# Only an escape writes a UTF-16 surrogate into a JSON string (UTF-8 cannot encode one).
_ESCAPED_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")


def parse_json(body: bytes) -> Any:
    """A request body's JSON; a 400 for what is not JSON text: invalid UTF-8, NaN and Infinity,
    nesting deeper than the parser's recursion, a string with half a surrogate pair."""
    try:
        raw = json.loads(body.decode(), parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise APIError(400, f"the request body is not valid JSON: {exc}") from exc
    if _ESCAPED_SURROGATE.search(body):
        try:
            json.dumps(raw, ensure_ascii=False).encode()
        except UnicodeEncodeError as exc:
            raise APIError(400, "the request body has a string with an unpaired UTF-16 surrogate") from exc
    return raw


def validate(model: type[BaseModel], raw: dict[str, Any]) -> Any:
    """Parse a body; a 400 names every bad field (a failed union reports one error per member:
    they are grouped by field, and the member that got furthest into the value speaks)."""
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        by_field: dict[Any, list[dict[str, Any]]] = {}
        for e in exc.errors():
            by_field.setdefault(e["loc"][:1], []).append(e)
        problems = []
        for errors in by_field.values():
            error = max(errors, key=lambda e: len(e["loc"]))  # (the first of the deepest)
            loc = _field_path(error["loc"]) or "body"
            if error["type"] == "extra_forbidden":
                problems.append((loc, f"unrecognized request argument {loc!r}"))
            else:
                problems.append((loc, f"invalid value for {loc!r}: {error['msg']}"))
        raise APIError(400, "; ".join(msg for _, msg in problems), param=problems[0][0]) from exc


def error_response(err: APIError) -> web.Response:
    return web.json_response(err.body(), status=err.status, headers=err.headers)


REQUEST_ID = web.RequestKey("request_id", str)


def request_id(request: web.Request) -> str:
    """The client's X-Request-Id if it sent one, else a new id: logged with errors and echoed in
    the response's x-request-id header (the body's `id` is the server's own, always unique)."""
    rid = request.get(REQUEST_ID)
    if rid is None:
        rid = request[REQUEST_ID] = request.headers.get("X-Request-Id") or uuid.uuid4().hex
    return rid


@web.middleware
async def errors_as_json(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except APIError as err:
        error = err
    except web.HTTPRequestEntityTooLarge as exc:
        error = APIError(413, f"request body too large: {exc.text}", code="request_too_large")
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        kind = "not_found_error" if exc.status == 404 else "invalid_request_error"
        error = APIError(exc.status, exc.reason, type=kind)
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        log.exception("unhandled error serving %s %s (request %s)", request.method, request.path, request_id(request))
        error = APIError(500, "internal server error", type="server_error")
    if error.status < 500:
        log.warning(
            "%s %s -> %d (request %s): %s",
            request.method,
            request.path,
            error.status,
            request_id(request),
            error.message,
        )
    error.headers.setdefault("x-request-id", request_id(request))
    return error_response(error)


SLO_HEADERS = {"ttft": c.SLO_TTFT_HEADER, "tbt": c.SLO_TBT_HEADER, "stall": c.SLO_STALL_HEADER}


def _slo_headers(request: web.Request) -> dict[str, float | None]:
    """The SLO targets a request's headers give (milliseconds by kind; None where absent); 400 on a bad one."""
    targets: dict[str, float | None] = dict.fromkeys(SLO_HEADERS)
    for kind, header in SLO_HEADERS.items():
        if header in request.headers:
            try:
                value = float(request.headers[header])
            except ValueError:
                value = -1.0
            if not 0 < value <= c.MAX_SLO_MS:
                raise APIError(400, f"header {header} must be a number of milliseconds in (0, {c.MAX_SLO_MS:g}]")
            targets[kind] = value
    return targets


class OpenAIServer:
    def __init__(self, engine: AsyncEngine | ProcessEngine, config: EngineConfig) -> None:
        """`engine`: the core on a thread of this process (AsyncEngine) or in a process of its own
        (ProcessEngine, whose `core` is a CoreView: what the server reads of the core)."""
        self.engine = engine
        self.core: EngineCore | CoreView = engine.core  # type: ignore[assignment]
        self.config = config
        self.model_name = config.model_name
        self.draining = False
        self.created = int(time.time())
        self.tool_call_parser = config.tool_call_parser or self._detected_tool_parser()

    def _detected_tool_parser(self) -> str | None:
        template = self.core.tokenizer.chat_template if self.core.tokenizer else None
        model = self.core.model_config
        rope_type = (model.rope_scaling or {}).get("rope_type")
        name = detect_parser(template, model.architecture, rope_type)
        if name is None:
            log.info("tool calls: no format found in the chat template; tool_choice 'auto' needs --tool-call-parser")
        else:
            log.info("tool calls: reading %s calls (from the model; --tool-call-parser overrides)", name)
        return name

    def build_app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_request_bytes, middlewares=[errors_as_json, self.auth])
        app.router.add_post(c.COMPLETIONS_PATH, self.completions)
        app.router.add_post(c.CHAT_COMPLETIONS_PATH, self.chat_completions)
        app.router.add_post(c.RESPONSES_PATH, self.responses)
        app.router.add_get(c.MODELS_PATH, self.models)
        app.router.add_get(c.MODELS_PATH + "/{model_id:.+}", self.model)  # ids like "Qwen/Qwen3-8B" have a slash
        app.router.add_get(c.HEALTH_PATH, self.health)
        app.router.add_get(c.READY_PATH, self.ready)
        app.router.add_get(c.METRICS_PATH, self.metrics)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/tokenizer_info", self.tokenizer_info)
        return app

    @web.middleware
    async def auth(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        key = self.config.api_key
        if key and request.path.startswith("/v1/") and request.headers.get("Authorization") != f"Bearer {key}":
            raise APIError(
                401,
                "invalid or missing API key (send 'Authorization: Bearer <key>')",
                type="authentication_error",
                code="invalid_api_key",
            )
        return await handler(request)

    # --- plain endpoints -------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        if self.engine.error is not None:
            return web.json_response({"status": "dead", "error": str(self.engine.error)}, status=503)
        return web.json_response({"status": "ok"})

    async def ready(self, request: web.Request) -> web.Response:
        if self.draining or self.engine.error is not None:
            return web.json_response({"status": "draining" if self.draining else "dead"}, status=503)
        return web.json_response({"status": "ready", "model": self.model_name})

    async def metrics(self, request: web.Request) -> web.Response:
        try:
            body = await self.engine.metrics_text()
        except asyncio.TimeoutError as exc:
            raise APIError(503, "the engine did not answer the scrape in time", type="server_error") from exc
        return web.Response(body=body, content_type="text/plain", charset="utf-8")

    def _model_card(self) -> dict[str, Any]:
        return {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "superinfer",
            "root": self.config.model,
            "max_model_len": self.core.max_model_len,
        }

    def _no_such_model(self, name: str) -> APIError:
        return APIError(
            404,
            f"the model {name!r} does not exist; this server serves {self.model_name!r}",
            type="not_found_error",
            param="model",
            code="model_not_found",
        )

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model_card()]})

    async def model(self, request: web.Request) -> web.Response:
        model_id = request.match_info["model_id"]
        if model_id != self.model_name:
            raise self._no_such_model(model_id)
        return web.json_response(self._model_card())

    # --- parsing ---------------------------------------------------------------------------
    def _check_capacity(self) -> None:
        if self.draining:
            raise APIError(503, "the server is shutting down", type="server_error", headers={"Retry-After": "5"})
        bound = self.config.max_waiting_requests
        if bound is not None and self.engine.num_queued >= bound:
            raise APIError(
                503,
                f"the server is overloaded: {bound} requests are already queued; retry later",
                type="server_error",
                code="overloaded",
                headers={"Retry-After": "1"},
            )

    async def _parse(self, request: web.Request, model: type[BaseModel]) -> Any:
        try:
            data = await request.read()
        except web.RequestPayloadError as exc:  # e.g. a Content-Encoding the body is not in
            raise APIError(400, f"the request body could not be read: {exc}") from exc
        raw = parse_json(data)
        if not isinstance(raw, dict):
            raise APIError(400, "the request body must be a JSON object")
        body = validate(model, raw)
        ignored = body.check_unknown()
        if ignored:
            shown = ", ".join(ignored[:20]) + (f" and {len(ignored) - 20} more" if len(ignored) > 20 else "")
            log.warning("request %s: ignoring unknown fields %s", request_id(request), shown)
        name = getattr(body, "model", None)
        if name is not None and name != self.model_name:
            raise self._no_such_model(name)
        body.check_supported()
        return body

    def _slo(self, request: web.Request, body: CompletionRequest | ChatCompletionRequest) -> tuple[str, SLO, int]:
        """The request's SLO class, targets and priority: the class's (body field, else header, else
        `default`), overridden field by field by the SLO headers, then by the body's `slo`/`priority`."""
        classes = self.core.slo_classes
        header = request.headers.get(c.SLO_CLASS_HEADER)
        name = body.slo_class if body.slo_class is not None else header
        if name is None:
            name = c.DEFAULT_SLO_CLASS
        elif name not in classes:
            from_body = body.slo_class is not None
            raise APIError(
                400,
                f"unknown SLO class {name!r} (from {'slo_class' if from_body else f'header {c.SLO_CLASS_HEADER}'}); "
                f"this server's classes are: {', '.join(sorted(classes))}",
                param="slo_class" if from_body else None,
                code="unknown_slo_class",
            )
        targets = _slo_headers(request)
        if body.slo is not None:
            targets["ttft"] = body.slo.ttft_ms or targets["ttft"]
            targets["tbt"] = body.slo.tbt_ms or targets["tbt"]
            targets["stall"] = body.slo.stall_ms or targets["stall"]
        try:
            slo, priority = resolve(classes[name], targets["ttft"], targets["tbt"], body.priority, targets["stall"])
        except ValueError as exc:  # a stall budget below the request's TBT target
            from_body = body.slo is not None and body.slo.stall_ms is not None
            raise APIError(
                400,
                f"{exc} (from {'slo.stall_ms' if from_body else f'header {c.SLO_STALL_HEADER}'})",
                param="slo.stall_ms" if from_body else None,
            ) from exc
        return name, slo, priority

    def _max_tokens(self, requested: int | None, num_prompt: int, prompt_field: str) -> int:
        room = self.core.max_model_len - num_prompt
        if room < 1:
            raise APIError(
                400,
                f"this model's maximum context length is {self.core.max_model_len} tokens; "
                f"the prompt has {num_prompt} tokens",
                param=prompt_field,
                code="context_length_exceeded",
            )
        if requested is None:
            return room
        if requested < 1:
            raise APIError(400, f"max_tokens must be at least 1, got {requested}", param="max_tokens")
        if requested > room:
            raise APIError(
                400,
                f"this model's maximum context length is {self.core.max_model_len} tokens; "
                f"you requested {num_prompt + requested} tokens ({num_prompt} in the prompt, "
                f"{requested} for the completion)",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return requested

    def _tokenizer(self) -> Tokenizer:
        if self.core.tokenizer is None:
            raise APIError(400, "this model has no tokenizer: send the prompt as a list of token ids", param="prompt")
        return self.core.tokenizer

    # --- tokenizer endpoints (vLLM's) ----------------------------------------------------------
    def _chat_prompt(self, body: ChatCompletionRequest | TokenizeRequest) -> str:
        tokenizer = self._tokenizer()
        messages = [m.for_template() for m in body.messages or ()]
        try:
            return tokenizer.apply_chat_template(
                messages,
                add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message,
                **(body.chat_template_kwargs or {}),
                **({"tools": body.tools} if getattr(body, "tools", None) else {}),
            )
        except Exception as exc:  # a template may raise on roles or orders it does not support
            raise APIError(400, f"the chat template rejected these messages: {exc}", param="messages") from exc

    async def tokenize(self, request: web.Request) -> web.Response:
        body: TokenizeRequest = await self._parse(request, TokenizeRequest)
        tokenizer = self._tokenizer()
        if body.messages is not None:
            ids = tokenizer.encode(self._chat_prompt(body), add_special_tokens=body.add_special_tokens is True)
        else:
            ids = tokenizer.encode(body.prompt or "", add_special_tokens=body.add_special_tokens is not False)
        result: dict[str, Any] = {"count": len(ids), "max_model_len": self.core.max_model_len, "tokens": ids}
        if body.return_token_strs:
            result["token_strs"] = [tokenizer.decode([t], skip_special_tokens=False) for t in ids]
        return web.json_response(result)

    async def detokenize(self, request: web.Request) -> web.Response:
        body: DetokenizeRequest = await self._parse(request, DetokenizeRequest)
        vocab = self.core.model_config.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise APIError(400, f"token ids must be in [0, {vocab})", param="tokens")
        return web.json_response({"prompt": self._tokenizer().decode(body.tokens, skip_special_tokens=False)})

    async def tokenizer_info(self, request: web.Request) -> web.Response:
        return web.json_response(self._tokenizer().info())

    # --- generation ------------------------------------------------------------------------
    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        return self._tokenizer().encode(prompt) if isinstance(prompt, str) else list(prompt)

    async def _compiled(self, spec: GuidedSpec | None, param: str) -> GuidedSpec | None:
        """Compile the request's grammar now (off the event loop; cached), so a schema the engine
        cannot follow is a 400 before anything runs."""
        if spec is None:
            return None
        if self.core.grammars is None:
            raise APIError(400, "structured output needs a tokenizer: this model has none", param=param)
        try:
            await asyncio.to_thread(self.core.grammars.compile, spec)
        except GrammarError as exc:
            raise APIError(400, str(exc), param=param) from exc
        return spec

    def _tool_parser(self, body: ChatCompletionRequest) -> ToolParser | None:
        """How tool calls are read from the output: the server's parser (the flag's, else the one the
        model's chat template implies) for tool_choice "auto"; for "required" or a named function the
        output is constrained to the parser's format (hermes when none is known)."""
        if not body.tools or body.tool_choice == "none":
            return None
        configured = self.tool_call_parser
        if body.tool_choice in (None, "auto"):
            if configured is None:
                raise APIError(
                    400,
                    "tool_choice 'auto' (the default with tools) needs to know how this model writes tool calls, "
                    "and its chat template does not say: start the server with --tool-call-parser (hermes for "
                    "Qwen2.5/Qwen3/Hermes, llama3_json for Llama 3.x); 'required' and named functions work without it",
                    param="tool_choice",
                )
            return get_parser(configured)
        return get_parser(configured or "hermes")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body: CompletionRequest = await self._parse(request, CompletionRequest)
        self._check_capacity()
        guided = await self._compiled(body.guided(), body.guided_field())
        prompts = [self._prompt_ids(p) for p in body.prompts()]
        score_only = body.max_tokens == 0  # echo scoring: generate one token, return none
        # With echo and logprobs the prompt tokens' logprobs are part of the answer.
        prompt_lps = body.logprobs if body.echo and body.logprobs is not None else None
        rid = f"cmpl-{uuid.uuid4().hex}"
        specs, requests = [], []
        for p, (prompt, ids) in enumerate(zip(body.prompts(), prompts, strict=True)):
            max_tokens = self._max_tokens(1 if score_only else body.max_tokens, len(ids), "prompt")
            sampling = body.sampling(max_tokens, body.logprobs, self.core.model_config.vocab_size, prompt_lps, guided)
            echo = None
            if body.echo:
                echo = prompt if isinstance(prompt, str) else self._tokenizer().decode(ids, skip_special_tokens=False)
            for j in range(body.n):
                index = p * body.n + j
                specs.append(ChoiceSpec(index, p, echo, tuple(ids), score_only, body.prompt_logprobs is not None))
                requests.append((ids, for_choice(sampling, index), j))
        fmt = CompletionFormat(rid, self.model_name, self.core.tokenizer, specs, sum(map(len, prompts)))
        return await self._generate(request, body, rid, requests, fmt)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body: ChatCompletionRequest = await self._parse(request, ChatCompletionRequest)
        self._check_capacity()
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        requests, fmt = await self._chat(body, rid)
        return await self._generate(request, body, rid, requests, fmt)

    async def responses(self, request: web.Request) -> web.StreamResponse:
        """The Responses API, answered by the chat pipeline (see `responses_request`)."""
        body: ResponsesRequest = await self._parse(request, ResponsesRequest)
        self._check_capacity()
        rid = f"resp_{uuid.uuid4().hex}"
        try:
            chat = validate(ChatCompletionRequest, body.to_chat())
            chat.check_supported()
            requests, fmt = await self._chat(chat, rid)
        except APIError as err:  # name the field as the client sent it
            err.param = RESPONSES_PARAMS.get(err.param or "", err.param)
            raise
        return await self._generate(request, chat, rid, requests, ResponsesFormat(fmt, body, rid))

    async def _chat(
        self, body: ChatCompletionRequest, rid: str
    ) -> tuple[list[tuple[list[int], SamplingParams, int]], ChatFormat]:
        """Render the chat, fix each choice's sampling (with the grammar a forced tool call or
        response_format sets) and the response's format: the engine requests and how to answer."""
        guided, param = body.guided(), body.guided_field()
        parser = self._tool_parser(body)
        if parser is not None and body.tool_choice not in (None, "auto"):
            if guided is not None:
                raise APIError(400, "a forced tool_choice cannot be combined with response_format", param="tool_choice")
            try:
                grammar = parser.guided_grammar(body.tools, body.tool_choice, body.parallel_tool_calls)
            except ValueError as exc:
                raise APIError(400, str(exc), param="tool_choice") from exc
            guided, param = GuidedSpec("grammar", grammar), "tool_choice"
        guided = await self._compiled(guided, param)
        ids = self._tokenizer().encode(self._chat_prompt(body), add_special_tokens=body.add_special_tokens)
        max_tokens = self._max_tokens(body.requested_max_tokens(), len(ids), "messages")
        vocab = self.core.model_config.vocab_size
        sampling = body.sampling(max_tokens, body.requested_logprobs(), vocab, guided=guided)
        wants = body.prompt_logprobs is not None
        specs = [ChoiceSpec(j, 0, prompt_token_ids=tuple(ids), prompt_logprobs=wants) for j in range(body.n)]
        requests = [(ids, for_choice(sampling, j), j) for j in range(body.n)]
        return requests, ChatFormat(rid, self.model_name, self.core.tokenizer, specs, len(ids), parser)

    async def _generate(
        self,
        request: web.Request,
        body: CompletionRequest | ChatCompletionRequest,
        rid: str,
        requests: list[tuple[list[int], SamplingParams, int]],
        fmt: CompletionFormat | ResponsesFormat,
    ) -> web.StreamResponse:
        """Start one engine request per choice (ids, sampling, its index among its prompt's n) and
        answer with all of them. A prompt's later choices wait for its first to compute the prompt
        and share its KV, unless each must score the prompt itself (prompt logprobs)."""
        slo_class, slo, priority = self._slo(request, body)
        streams = []
        for index, (ids, sampling, j) in enumerate(requests):
            first = f"{rid}-{index - j}"
            after = first if j and sampling.prompt_logprobs is None else None
            streams.append(self.engine.generate(f"{rid}-{index}", ids, sampling, slo, priority, slo_class, after))
        options = body.stream_options
        return await self._respond(
            request,
            streams,
            fmt,
            body.stream,
            include_usage=bool(options and options.include_usage),
            continuous_usage=bool(options and options.continuous_usage_stats),
        )

    async def _respond(
        self,
        request: web.Request,
        streams: list[AsyncIterator[RequestOutput]],
        fmt: CompletionFormat | ResponsesFormat,
        stream: bool,
        include_usage: bool,
        continuous_usage: bool,
    ) -> web.StreamResponse:
        headers = {"x-request-id": request_id(request)}
        async with aclosing(merge(streams)) as it:
            try:
                outs: dict[int, list[RequestOutput]] = {}
                if not stream:
                    async for index, out in it:
                        outs.setdefault(index, []).append(out)
                else:
                    first = await anext(it, None)  # errors before the first token still get a JSON status
            except (ValueError, EngineDeadError) as exc:
                raise engine_error(exc) from exc
            if not stream:
                return web.json_response(fmt.full(outs), headers=headers)
            resp = web.StreamResponse(
                headers={**headers, "Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
            )
            await resp.prepare(request)
            try:
                if isinstance(fmt, ResponsesFormat):
                    await self._stream_events(resp, it, fmt, first)
                else:
                    await self._stream(resp, it, fmt, first, include_usage, continuous_usage)
            except ConnectionResetError:  # the client left mid-stream; closing `it` aborts its requests
                log.info("request %s: the client disconnected mid-stream", request_id(request))
            return resp

    async def _stream(
        self,
        resp: web.StreamResponse,
        it: AsyncIterator[tuple[int, RequestOutput]],
        fmt: CompletionFormat,
        first: tuple[int, RequestOutput] | None,
        include_usage: bool,
        continuous_usage: bool,
    ) -> None:
        usage_field = {"usage": None} if include_usage and not continuous_usage else {}
        for start in fmt.start():
            await resp.write(sse({**start, **({"usage": fmt.usage()} if continuous_usage else usage_field)}))
        try:
            if first is not None:
                await self._write_chunk(resp, fmt, first, continuous_usage, usage_field)
                async for item in it:
                    await self._write_chunk(resp, fmt, item, continuous_usage, usage_field)
            if include_usage:
                await resp.write(sse(fmt.usage_chunk()))
        except (ValueError, EngineDeadError) as exc:  # the status line is gone: report in-stream
            await resp.write(sse(engine_error(exc).body()))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()

    @staticmethod
    async def _stream_events(
        resp: web.StreamResponse,
        it: AsyncIterator[tuple[int, RequestOutput]],
        fmt: ResponsesFormat,
        first: tuple[int, RequestOutput] | None,
    ) -> None:
        """The Responses API's stream: typed events, a terminal one last."""
        for event in fmt.start():
            await resp.write(sse_event(event))
        try:
            if first is not None:
                for event in fmt.events(*first):
                    await resp.write(sse_event(event))
                async for item in it:
                    for event in fmt.events(*item):
                        await resp.write(sse_event(event))
            end = fmt.finish()
        except (ValueError, EngineDeadError) as exc:  # the status line is gone: report in-stream
            end = fmt.fail(engine_error(exc))
        for event in end:
            await resp.write(sse_event(event))
        await resp.write_eof()

    @staticmethod
    async def _write_chunk(
        resp: web.StreamResponse,
        fmt: CompletionFormat,
        item: tuple[int, RequestOutput],
        continuous_usage: bool,
        usage_field: dict[str, None],
    ) -> None:
        chunk = fmt.chunk(*item, continuous_usage)
        if chunk is not None:
            await resp.write(sse({**chunk, **usage_field}))


async def merge(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(choice index, output) from several output streams as they come; the first error ends it.
    Closing it early closes every stream (which aborts its engine request)."""
    if len(streams) == 1:
        async with aclosing(streams[0]) as only:
            async for out in only:
                yield 0, out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput] | BaseException | None] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async with aclosing(stream) as outs:
                async for out in outs:
                    queue.put_nowait((index, out))
        except Exception as exc:
            queue.put_nowait(exc)
        finally:
            queue.put_nowait(None)

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        done = 0
        while done < len(tasks):
            item = await queue.get()
            if item is None:
                done += 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def engine_error(exc: Exception) -> APIError:
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), type="server_error")
    return APIError(400, str(exc))


_COMPACT_JSON = json.JSONEncoder(separators=(",", ":"))  # (json.dumps with options builds an encoder per call)


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + _COMPACT_JSON.encode(payload).encode() + b"\n\n"


# --- running it -------------------------------------------------------------------------------
class RunningServer:
    """An engine and its HTTP server started on an event loop; `port` is the bound port."""

    def __init__(self, server: OpenAIServer, runner: web.AppRunner, port: int) -> None:
        self.server, self.runner, self.port = server, runner, port

    @property
    def url(self) -> str:
        return f"http://{self.server.config.host}:{self.port}"

    async def drain(self, timeout_s: float) -> None:
        """Stop taking requests (/ready turns 503) and wait for the live ones to finish."""
        self.server.draining = True
        deadline = time.monotonic() + timeout_s
        while self.server.engine.num_live and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    async def close(self, timeout_s: float | None = None) -> None:
        await self.runner.cleanup()
        await self.server.engine.stop(timeout_s)


def check_listen(host: str, port: int) -> None:
    """A ValueError naming --host or --port when the server could not listen there: checked before
    the model loads, rather than failing (with an engine left running) once it has."""
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ValueError(f"--host {host!r}: {exc.strerror}") from None
    for family, kind, proto, _, address in addresses if port else ():
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server's own socket
            try:
                probe.bind(address)
            except OSError as exc:
                raise ValueError(f"--port {port} on {address[0]}: {exc.strerror}") from None


async def start_server(config: EngineConfig, core: EngineCore | None = None) -> RunningServer:
    """With `config.engine_process` (and no `core` given) the engine core runs in a child process."""
    check_listen(config.host, config.port)
    engine: AsyncEngine | ProcessEngine
    if core is None and config.engine_process:
        engine = ProcessEngine(config)
    else:
        engine = AsyncEngine(core or await asyncio.to_thread(EngineCore, config))
    await engine.start()
    server = OpenAIServer(engine, config)
    runner = web.AppRunner(server.build_app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port)
    try:
        await site.start()
    except OSError as exc:  # taken since the check: stop the engine, or its process keeps this one alive
        await runner.cleanup()
        await engine.stop(DEAD_ENGINE_GRACE_S)
        raise ValueError(f"cannot listen on {config.host}:{config.port}: {exc.strerror or exc}") from None
    port = site._server.sockets[0].getsockname()[1]  # the bound port, also when config.port is 0
    return RunningServer(server, runner, port)


DEAD_ENGINE_GRACE_S = 5.0  # a dead engine's live requests get their 503 within this, then the process exits


async def serve(config: EngineConfig) -> None:
    """Run until SIGTERM/SIGINT, then drain: finish live requests, up to the shutdown timeout.
    If the engine dies (a failed step, a lost tensor-parallel worker), the live requests and any
    new ones get 503, and the server stops and raises EngineDeadError (the CLI exits non-zero)."""
    running = await start_server(config)
    freeze_startup_heap("server process")
    log.info("serving %r on %s", config.model_name, running.url)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    engine = running.server.engine
    waits = [asyncio.create_task(stop.wait()), asyncio.create_task(engine.died.wait())]
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for task in waits:
        task.cancel()
    if engine.error is not None:
        log.error("the engine failed (%s): stopping the server", engine.error)
        running.server.draining = True
        await running.drain(DEAD_ENGINE_GRACE_S)  # the live requests already have their error
        await running.close(timeout_s=DEAD_ENGINE_GRACE_S)
        raise EngineDeadError(f"the engine failed: {engine.error}")
    log.info("draining (up to %.0f s)", config.shutdown_timeout_s)
    await running.drain(config.shutdown_timeout_s)
    await running.close()
