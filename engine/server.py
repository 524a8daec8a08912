"""The OpenAI-compatible HTTP server (aiohttp): completions, chat, SSE streaming, health, metrics.

Every error is an OpenAI-style JSON body with a fitting status; a bad request never disturbs
the others. A client that goes away aborts its request, which frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any

from aiohttp import web
from pydantic import BaseModel, ValidationError

from superinfer.engine import contract as c
from superinfer.engine.config import EngineConfig
from superinfer.engine.engine import AsyncEngine, EngineCore, EngineDeadError
from superinfer.engine.output import RequestOutput
from superinfer.engine.protocol import APIError, ChatCompletionRequest, CompletionRequest
from superinfer.engine.slo import SLO
from superinfer.engine.slo_classes import resolve
from superinfer.engine.tokenizer import Tokenizer
from superinfer.engine.worker.runner import TokenLogprob

log = logging.getLogger("superinfer.server")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def common_prefix(paths: list[tuple]) -> tuple:
    """The shared start of error locations (a failed union reports one location per member)."""
    first = paths[0]
    n = next((i for i in range(len(first)) if any(len(p) <= i or p[i] != first[i] for p in paths)), len(first))
    return first[:n]


def error_response(err: APIError) -> web.Response:
    return web.json_response(err.body(), status=err.status, headers=err.headers)


@web.middleware
async def errors_as_json(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except APIError as err:
        return error_response(err)
    except web.HTTPRequestEntityTooLarge as exc:
        return error_response(APIError(413, f"request body too large: {exc.text}", code="request_too_large"))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        kind = "not_found_error" if exc.status == 404 else "invalid_request_error"
        return error_response(APIError(exc.status, exc.reason, type=kind))
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        log.exception("unhandled error serving %s %s", request.method, request.path)
        return error_response(APIError(500, "internal server error", type="server_error"))


class OpenAIServer:
    def __init__(self, engine: AsyncEngine, config: EngineConfig) -> None:
        self.engine = engine
        self.core: EngineCore = engine.core
        self.config = config
        self.model_name = config.model_name
        self.draining = False
        self.created = int(time.time())

    def build_app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_request_bytes, middlewares=[errors_as_json, self.auth])
        app.router.add_post(c.COMPLETIONS_PATH, self.completions)
        app.router.add_post(c.CHAT_COMPLETIONS_PATH, self.chat_completions)
        app.router.add_get(c.MODELS_PATH, self.models)
        app.router.add_get(c.HEALTH_PATH, self.health)
        app.router.add_get(c.READY_PATH, self.ready)
        app.router.add_get(c.METRICS_PATH, self.metrics)
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
        return web.Response(body=self.core.metrics.render(), content_type="text/plain", charset="utf-8")

    async def models(self, request: web.Request) -> web.Response:
        card = {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "superinfer",
            "root": self.config.model,
            "max_model_len": self.core.max_model_len,
        }
        return web.json_response({"object": "list", "data": [card]})

    # --- generation ------------------------------------------------------------------------
    async def _parse(self, request: web.Request, model: type[BaseModel]) -> Any:
        if self.draining:
            raise APIError(503, "the server is shutting down", type="server_error", headers={"Retry-After": "5"})
        bound = self.config.max_waiting_requests
        scheduler = self.core.scheduler
        if bound is not None and self.engine.num_live - scheduler.num_running - scheduler.num_rotary >= bound:
            raise APIError(
                503,
                f"the server is overloaded: {bound} requests are already queued; retry later",
                type="server_error",
                code="overloaded",
                headers={"Retry-After": "1"},
            )
        try:
            raw = await request.json()
        except json.JSONDecodeError as exc:
            raise APIError(400, f"the request body is not valid JSON: {exc}") from exc
        if not isinstance(raw, dict):
            raise APIError(400, "the request body must be a JSON object")
        try:
            body = model.model_validate(raw)
        except ValidationError as exc:
            errors = exc.errors()
            loc = ".".join(str(p) for p in common_prefix([e["loc"] for e in errors]))
            if errors[0]["type"] == "extra_forbidden":
                raise APIError(400, f"unrecognized request argument: {loc!r}", param=loc) from exc
            raise APIError(400, f"invalid value for {loc!r}: {errors[0]['msg']}", param=loc) from exc
        if body.model != self.model_name:
            raise APIError(
                404,
                f"the model {body.model!r} does not exist; this server serves {self.model_name!r}",
                type="not_found_error",
                param="model",
                code="model_not_found",
            )
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
        targets: dict[str, float | None] = {"ttft": None, "tbt": None}
        for header, kind in ((c.SLO_TTFT_HEADER, "ttft"), (c.SLO_TBT_HEADER, "tbt")):
            if header in request.headers:
                try:
                    value = float(request.headers[header])
                except ValueError:
                    value = -1.0
                if not value > 0:
                    raise APIError(400, f"header {header} must be a positive number of milliseconds")
                targets[kind] = value
        if body.slo is not None:
            targets["ttft"] = body.slo.ttft_ms or targets["ttft"]
            targets["tbt"] = body.slo.tbt_ms or targets["tbt"]
        slo, priority = resolve(classes[name], targets["ttft"], targets["tbt"], body.priority)
        return name, slo, priority

    def _max_tokens(self, requested: int | None, num_prompt: int) -> int:
        room = self.core.max_model_len - num_prompt
        if room < 1:
            raise APIError(
                400,
                f"this model's maximum context length is {self.core.max_model_len} tokens; "
                f"the prompt has {num_prompt} tokens",
                param="messages",
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

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body: CompletionRequest = await self._parse(request, CompletionRequest)
        prompt = body.single_prompt()
        ids = self._tokenizer().encode(prompt) if isinstance(prompt, str) else list(prompt)
        sampling = body.sampling(self._max_tokens(body.max_tokens, len(ids)), body.logprobs)
        rid = f"cmpl-{uuid.uuid4().hex}"
        slo_class, slo, priority = self._slo(request, body)
        outputs = self.engine.generate(rid, ids, sampling, slo, priority, slo_class)
        usage = bool(body.stream_options and body.stream_options.include_usage)
        fmt = CompletionFormat(rid, self.model_name, self.core.tokenizer)
        return await self._respond(request, outputs, fmt, body.stream, usage)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body: ChatCompletionRequest = await self._parse(request, ChatCompletionRequest)
        tokenizer = self._tokenizer()
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except Exception as exc:  # a template may raise on roles or orders it does not support
            raise APIError(400, f"the chat template rejected these messages: {exc}", param="messages") from exc
        ids = tokenizer.encode(text, add_special_tokens=False)
        sampling = body.sampling(self._max_tokens(body.requested_max_tokens(), len(ids)), body.requested_logprobs())
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        slo_class, slo, priority = self._slo(request, body)
        outputs = self.engine.generate(rid, ids, sampling, slo, priority, slo_class)
        usage = bool(body.stream_options and body.stream_options.include_usage)
        fmt = ChatFormat(rid, self.model_name, tokenizer)
        return await self._respond(request, outputs, fmt, body.stream, usage)

    async def _respond(
        self,
        request: web.Request,
        outputs: AsyncIterator[RequestOutput],
        fmt: CompletionFormat,
        stream: bool,
        include_usage: bool,
    ) -> web.StreamResponse:
        headers = {"x-request-id": fmt.rid}
        async with aclosing(outputs) as it:
            try:
                if not stream:
                    return web.json_response(fmt.full([out async for out in it]), headers=headers)
                first = await anext(it, None)  # errors before the first token still get a JSON status
            except (ValueError, EngineDeadError) as exc:
                raise engine_error(exc) from exc
            resp = web.StreamResponse(
                headers={**headers, "Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
            )
            await resp.prepare(request)
            start = fmt.start()
            if start is not None:
                await resp.write(sse(start))
            last = first
            try:
                if first is not None:
                    await resp.write(sse(fmt.chunk(first)))
                    async for out in it:
                        await resp.write(sse(fmt.chunk(out)))
                        last = out
                if include_usage and last is not None:
                    await resp.write(sse(fmt.usage_chunk(last)))
            except (ValueError, EngineDeadError) as exc:  # the status line is gone: report in-stream
                await resp.write(sse(engine_error(exc).body()))
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp


def engine_error(exc: Exception) -> APIError:
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), type="server_error")
    return APIError(400, str(exc))


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def _usage(out: RequestOutput) -> dict[str, Any]:
    return {
        "prompt_tokens": out.num_prompt_tokens,
        "completion_tokens": out.num_output_tokens,
        "total_tokens": out.num_prompt_tokens + out.num_output_tokens,
        "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens},
    }


class CompletionFormat:
    """Response bodies of /v1/completions."""

    object_name = "text_completion"

    def __init__(self, rid: str, model: str, tokenizer: Any) -> None:
        self.rid, self.model, self.tokenizer = rid, model, tokenizer
        self.created = int(time.time())
        self.offset = 0

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False) if self.tokenizer else str(token_id)

    def _envelope(self, choices: list[dict[str, Any]], obj: str | None = None) -> dict[str, Any]:
        return {
            "id": self.rid,
            "object": obj or self.object_name,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def logprobs(self, items: list[TokenLogprob] | None, text_offset: int) -> dict[str, Any] | None:
        if items is None:
            return None
        tokens = [self._token_text(lp.token_id) for lp in items]
        offsets = []
        for tok in tokens:
            offsets.append(text_offset)
            text_offset += len(tok)
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in items],
            "top_logprobs": [{self._token_text(t): v for t, v in lp.top} for lp in items],
            "text_offset": offsets,
        }

    def start(self) -> dict[str, Any] | None:
        return None

    def chunk(self, out: RequestOutput) -> dict[str, Any]:
        choice = {
            "index": 0,
            "text": out.text,
            "logprobs": self.logprobs(out.logprobs, self.offset),
            "finish_reason": out.finish_reason,
        }
        self.offset += len(out.text)
        return self._envelope([choice])

    def usage_chunk(self, last: RequestOutput) -> dict[str, Any]:
        return {**self._envelope([]), "usage": _usage(last)}

    def full(self, outs: list[RequestOutput]) -> dict[str, Any]:
        last = outs[-1]
        lps = [lp for o in outs for lp in (o.logprobs or [])] if last.logprobs is not None else None
        choice = {
            "index": 0,
            "text": "".join(o.text for o in outs),
            "logprobs": self.logprobs(lps, 0),
            "finish_reason": last.finish_reason,
        }
        return {**self._envelope([choice]), "usage": _usage(last)}


class ChatFormat(CompletionFormat):
    """Response bodies of /v1/chat/completions."""

    object_name = "chat.completion.chunk"

    def logprobs(self, items: list[TokenLogprob] | None, text_offset: int) -> dict[str, Any] | None:
        if items is None:
            return None

        def entry(token_id: int, logprob: float) -> dict[str, Any]:
            text = self._token_text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return {
            "content": [
                {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in items
            ]
        }

    def start(self) -> dict[str, Any] | None:
        return self._envelope(
            [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]
        )

    def chunk(self, out: RequestOutput) -> dict[str, Any]:
        delta = {"content": out.text} if out.text or not out.finished else {}
        return self._envelope(
            [
                {
                    "index": 0,
                    "delta": delta,
                    "logprobs": self.logprobs(out.logprobs, 0),
                    "finish_reason": out.finish_reason,
                }
            ]
        )

    def full(self, outs: list[RequestOutput]) -> dict[str, Any]:
        last = outs[-1]
        lps = [lp for o in outs for lp in (o.logprobs or [])] if last.logprobs is not None else None
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": "".join(o.text for o in outs)},
            "logprobs": self.logprobs(lps, 0),
            "finish_reason": last.finish_reason,
        }
        return {**self._envelope([choice], "chat.completion"), "usage": _usage(last)}


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

    async def close(self) -> None:
        await self.runner.cleanup()
        await self.server.engine.stop()


async def start_server(config: EngineConfig, core: EngineCore | None = None) -> RunningServer:
    core = core or await asyncio.to_thread(EngineCore, config)
    engine = AsyncEngine(core)
    await engine.start()
    server = OpenAIServer(engine, config)
    runner = web.AppRunner(server.build_app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # the bound port, also when config.port is 0
    return RunningServer(server, runner, port)


async def serve(config: EngineConfig) -> None:
    """Run until SIGTERM/SIGINT, then drain: finish live requests, up to the shutdown timeout."""
    running = await start_server(config)
    log.info("serving %r on %s", config.model_name, running.url)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("draining (up to %.0f s)", config.shutdown_timeout_s)
    await running.drain(config.shutdown_timeout_s)
    await running.close()
