"""OpenAI response bodies for /v1/completions and /v1/chat/completions, whole or streamed.

A request has one choice per prompt times `n`, indexed prompt by prompt; each choice is one engine
request, whose outputs arrive here in order (the choices interleave). Usage counts each prompt
once and every choice's tokens.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from superinfer.engine.output import RequestOutput
from superinfer.engine.serving.tool_parsers import ContentDelta, ToolCallDelta, ToolParser
from superinfer.engine.tokenizer import Tokenizer
from superinfer.engine.worker.runner import TokenLogprob


@dataclass(frozen=True)
class ChoiceSpec:
    """What the response needs to know about a choice before its outputs arrive."""

    index: int
    prompt_index: int
    echo: str | None = None  # prompt text to put before the completion (completions' echo)
    prompt_token_ids: tuple[int, ...] = ()  # for echo and prompt logprobs
    score_only: bool = False  # max_tokens 0 with echo: the generated token is dropped
    prompt_logprobs: bool = False  # the request asked for vLLM's `prompt_logprobs` field


class CompletionFormat:
    """Response bodies of /v1/completions."""

    object_name = "text_completion"

    def __init__(
        self, rid: str, model: str, tokenizer: Tokenizer | None, choices: list[ChoiceSpec], prompt_tokens: int
    ) -> None:
        self.rid, self.model, self.tokenizer = rid, model, tokenizer
        self.choices = choices
        self.prompt_tokens = prompt_tokens
        self.created = int(time.time())
        self.offsets = [0] * len(choices)  # completions' logprobs text_offset, per choice
        self.started = [False] * len(choices)
        self.completion_tokens = [0] * len(choices)
        self.cached_tokens: dict[int, int] = {}  # per prompt, as its first choice reports it

    # --- pieces -----------------------------------------------------------------------------
    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False) if self.tokenizer else str(token_id)

    def _envelope(self, choices: list[dict[str, Any]], obj: str | None = None) -> dict[str, Any]:
        return {
            "id": self.rid,
            "object": obj or self.object_name,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def _count(self, index: int, out: RequestOutput) -> None:
        spec = self.choices[index]
        self.completion_tokens[index] = 0 if spec.score_only else out.num_output_tokens
        self.cached_tokens.setdefault(spec.prompt_index, out.num_cached_tokens)

    def usage(self) -> dict[str, Any]:
        completion = sum(self.completion_tokens)
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": sum(self.cached_tokens.values())},
        }

    def _prompt_entries(self, spec: ChoiceSpec, out: RequestOutput) -> list[tuple[int, TokenLogprob | None]]:
        lps = out.prompt_logprobs or [None] * len(spec.prompt_token_ids)
        return list(zip(spec.prompt_token_ids, lps, strict=True))

    def logprobs(self, entries: list[tuple[int, TokenLogprob | None]], text_offset: int) -> dict[str, Any] | None:
        tokens = [self.token_text(token) for token, _ in entries]
        offsets = []
        for tok in tokens:
            offsets.append(text_offset)
            text_offset += len(tok)
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob if lp else None for _, lp in entries],
            "top_logprobs": [{self.token_text(t): v for t, v in lp.top} if lp else None for _, lp in entries],
            "text_offset": offsets,
        }

    def _choice(self, index: int, outs: list[RequestOutput], first: bool) -> dict[str, Any]:
        """The choice body for `outs`, the consecutive outputs of choice `index`."""
        spec, last = self.choices[index], outs[-1]
        text = "" if spec.score_only else "".join(o.text for o in outs)
        entries: list[tuple[int, TokenLogprob | None]] = []
        if first and spec.echo is not None:
            text = spec.echo + text
            entries = self._prompt_entries(spec, outs[0])
        if last.logprobs is not None and not spec.score_only:
            entries += [(lp.token_id, lp) for o in outs for lp in (o.logprobs or [])]
        wants_logprobs = last.logprobs is not None
        choice = {
            "index": index,
            "text": text,
            "logprobs": self.logprobs(entries, self.offsets[index]) if wants_logprobs else None,
            "finish_reason": last.finish_reason,
        }
        if first and spec.prompt_logprobs and outs[0].prompt_logprobs is not None:
            choice["prompt_logprobs"] = self.prompt_logprobs(spec, outs[0])
        self.offsets[index] += len(text)
        return choice

    def prompt_logprobs(self, spec: ChoiceSpec, out: RequestOutput) -> list[dict[str, Any] | None]:
        """vLLM's `prompt_logprobs`: per prompt token {token id: {logprob, rank, decoded_token}}."""
        result: list[dict[str, Any] | None] = []
        for token, lp in self._prompt_entries(spec, out):
            if lp is None:
                result.append(None)
                continue
            ranked = {token: (lp.logprob, lp.rank)}
            ranked |= {t: (v, rank) for rank, (t, v) in enumerate(lp.top, start=1)}
            result.append(
                {
                    str(t): {"logprob": v, "rank": rank, "decoded_token": self.token_text(t)}
                    for t, (v, rank) in ranked.items()
                }
            )
        return result

    # --- streaming --------------------------------------------------------------------------
    def start(self) -> list[dict[str, Any]]:
        return []

    def chunk(self, index: int, out: RequestOutput, continuous_usage: bool) -> dict[str, Any] | None:
        """The chunk for one output, or None when it carries nothing (text held back)."""
        first, self.started[index] = not self.started[index], True
        self._count(index, out)
        choice = self._choice(index, [out], first)
        carries = choice["text"] or choice["logprobs"] is not None or "prompt_logprobs" in choice
        if not carries and not out.finished:
            return None
        body = self._envelope([choice])
        if continuous_usage:
            body["usage"] = self.usage()
        return body

    def usage_chunk(self) -> dict[str, Any]:
        return {**self._envelope([]), "usage": self.usage()}

    # --- whole ------------------------------------------------------------------------------
    def full(self, outs: dict[int, list[RequestOutput]]) -> dict[str, Any]:
        choices = []
        for index in sorted(outs):
            self._count(index, outs[index][-1])
            choices.append(self._choice(index, outs[index], True))
        return {**self._envelope(choices), "usage": self.usage()}


class ChatFormat(CompletionFormat):
    """Response bodies of /v1/chat/completions."""

    object_name = "chat.completion.chunk"

    def logprobs(self, entries: list[tuple[int, TokenLogprob | None]], text_offset: int) -> dict[str, Any] | None:
        def entry(token_id: int, logprob: float) -> dict[str, Any]:
            text = self.token_text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return {
            "content": [
                {**entry(t, lp.logprob), "top_logprobs": [entry(a, v) for a, v in lp.top]}
                for t, lp in entries
                if lp is not None
            ]
        }

    def __init__(
        self,
        rid: str,
        model: str,
        tokenizer: Tokenizer | None,
        choices: list[ChoiceSpec],
        prompt_tokens: int,
        tool_parser: ToolParser | None = None,
    ) -> None:
        super().__init__(rid, model, tokenizer, choices, prompt_tokens)
        self.tool_parser = tool_parser
        self.tool_streams = [tool_parser.stream() for _ in choices] if tool_parser else []
        self.call_ids: list[dict[int, str]] = [{} for _ in choices]  # per choice: call index -> id

    def _call_id(self, index: int, call: int) -> str:
        return self.call_ids[index].setdefault(call, f"call_{uuid.uuid4().hex[:24]}")

    def _finish_reason(self, index: int, reason: str | None) -> str | None:
        return "tool_calls" if reason == "stop" and self.call_ids[index] else reason

    def _choice(self, index: int, outs: list[RequestOutput], first: bool) -> dict[str, Any]:
        base = super()._choice(index, outs, first)
        message: dict[str, Any] = {"role": "assistant", "content": base.pop("text")}
        if self.tool_parser is not None:
            parsed = self.tool_parser.parse(message["content"], truncated=base["finish_reason"] == "length")
            message["content"] = parsed.content
            if parsed.tool_calls:
                message["tool_calls"] = [
                    {
                        "id": self._call_id(index, i),
                        "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments_json},
                    }
                    for i, call in enumerate(parsed.tool_calls)
                ]
        base["finish_reason"] = self._finish_reason(index, base["finish_reason"])
        return {"index": index, "message": message, **base}

    def start(self) -> list[dict[str, Any]]:
        return [
            self._envelope(
                [
                    {
                        "index": c.index,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ]
            )
            for c in self.choices
        ]

    def chunk(self, index: int, out: RequestOutput, continuous_usage: bool) -> dict[str, Any] | None:
        first, self.started[index] = not self.started[index], True
        self._count(index, out)
        base = CompletionFormat._choice(self, index, [out], first)
        text = base.pop("text")
        delta: dict[str, Any] = {}
        if self.tool_parser is not None:
            stream = self.tool_streams[index]
            events = stream.feed(text) + (stream.finish(out.finish_reason == "length") if out.finished else [])
            text = "".join(e.text for e in events if isinstance(e, ContentDelta))
            calls = [self._call_delta(index, e) for e in events if isinstance(e, ToolCallDelta)]
            if calls:
                delta["tool_calls"] = calls
        if text:
            delta["content"] = text
        if not delta and base["logprobs"] is None and not out.finished:
            return None
        base["finish_reason"] = self._finish_reason(index, base["finish_reason"])
        body = self._envelope([{"index": index, "delta": delta, **base}])
        if continuous_usage:
            body["usage"] = self.usage()
        return body

    def _call_delta(self, index: int, event: ToolCallDelta) -> dict[str, Any]:
        function: dict[str, Any] = {"arguments": event.arguments}
        delta: dict[str, Any] = {"index": event.index}
        if event.name is not None:  # a call's first delta: its id, type and name
            delta |= {"id": self._call_id(index, event.index), "type": "function"}
            function["name"] = event.name
        return {**delta, "function": function}

    def full(self, outs: dict[int, list[RequestOutput]]) -> dict[str, Any]:
        body = super().full(outs)
        body["object"] = "chat.completion"
        return body
