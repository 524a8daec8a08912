"""OpenAI-compatible request bodies, and the conversion to SamplingParams.

Fields follow OpenAI's API plus vLLM's well-known extras (top_k, min_p, repetition_penalty, ...),
which clients and harnesses send. An explicit null means the field's default. A field the server
does not know is ignored with a warning, as vLLM does, unless it looks like a typo of a known one
(then it is a 400 that says which field was meant).
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from superinfer.engine.contract import MAX_SLO_MS, PRIORITY_MAX, PRIORITY_MIN
from superinfer.engine.core.request import (
    REPETITION_PENALTY_MAX,
    REPETITION_PENALTY_MIN,
    SEED_MAX,
    SEED_MIN,
    SamplingParams,
)
from superinfer.engine.output_constraint import GrammarError, GuidedSpec
from superinfer.engine.serving.tool_parsers import functions


class APIError(Exception):
    """An error with an HTTP status and the OpenAI error body fields."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


MAX_N = 128
MAX_STOPS = 128  # distinct stop strings, and stop token ids, a request may give
MAX_TYPO_CHECKS = 32  # unknown fields compared with the known ones for a likely typo
LOGIT_BIAS_LIMIT = 100.0


class _Body(BaseModel):
    """A request body: unknown fields kept aside (see `unknown_fields`), null means default."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        defaults = cls.model_fields
        return {k: v for k, v in data.items() if v is not None or k not in defaults or defaults[k].default is None}

    def unknown_fields(self) -> list[str]:
        return sorted(self.model_extra or {})

    def check_unknown(self) -> list[str]:
        """Refuse likely typos by name; return the fields to ignore."""
        unknown = self.unknown_fields()
        for name in unknown[:MAX_TYPO_CHECKS]:
            close = difflib.get_close_matches(name, list(type(self).model_fields), n=1, cutoff=0.8)
            if close:
                raise APIError(400, f"unrecognized request argument {name!r}: did you mean {close[0]!r}?", param=name)
        return unknown


class SLOField(BaseModel):
    model_config = ConfigDict(extra="forbid")  # our own field: strict
    ttft_ms: float | None = Field(None, gt=0, le=MAX_SLO_MS)
    tbt_ms: float | None = Field(None, gt=0, le=MAX_SLO_MS)
    stall_ms: float | None = Field(None, gt=0, le=MAX_SLO_MS)  # at least the request's TBT target


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: the running usage on every chunk


class CommonFields(_Body):
    model: str
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1)
    min_p: float = Field(0.0, ge=0, le=1)
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, ge=REPETITION_PENALTY_MIN, le=REPETITION_PENALTY_MAX)
    logit_bias: dict[str, float] | None = None
    prompt_logprobs: int | None = Field(None, ge=0, le=20)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # as in HF's fast tokenizers, which ignore it
    response_format: ResponseFormat | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None
    user: str | None = None
    slo_class: str | None = None
    slo: SLOField | None = None
    priority: int | None = Field(None, ge=PRIORITY_MIN, le=PRIORITY_MAX)  # None: the SLO class's priority

    def check_supported(self) -> None:
        """Combinations the API refuses (beyond each field's own range)."""

    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(dict.fromkeys(self.stop))
        if any(not s for s in stops):
            raise APIError(400, "stop strings must not be empty", param="stop")
        if len(stops) > MAX_STOPS:  # each is searched for after every token
            raise APIError(400, f"at most {MAX_STOPS} stop strings, got {len(stops)}", param="stop")
        return stops

    def logit_biases(self, vocab_size: int) -> tuple[tuple[int, float], ...]:
        """logit_bias as (token id, bias) pairs, each bias clamped to [-100, 100]."""
        pairs = []
        for key, bias in (self.logit_bias or {}).items():
            if not key.isdigit() or int(key) >= vocab_size:
                raise APIError(
                    400, f"logit_bias keys must be token ids in [0, {vocab_size}), got {key!r}", param="logit_bias"
                )
            pairs.append((int(key), max(-LOGIT_BIAS_LIMIT, min(LOGIT_BIAS_LIMIT, bias))))
        return tuple(pairs)

    def stop_token_id_tuple(self, vocab_size: int) -> tuple[int, ...]:
        ids = tuple(dict.fromkeys(self.stop_token_ids or ()))
        if len(ids) > MAX_STOPS:  # banned one by one in every step until min_tokens
            raise APIError(400, f"at most {MAX_STOPS} stop_token_ids, got {len(ids)}", param="stop_token_ids")
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise APIError(
                400, f"stop_token_ids must be token ids in [0, {vocab_size}), got {bad[:10]}", param="stop_token_ids"
            )
        return ids

    def guided(self) -> GuidedSpec | None:
        """The output constraint the request sets (response_format or vLLM's fields), if any."""
        try:
            return GuidedSpec.from_request(
                response_format=self.response_format.model_dump() if self.response_format else None,
                guided_json=self.guided_json,
                guided_regex=self.guided_regex,
                guided_choice=self.guided_choice,
                guided_grammar=self.guided_grammar,
                structured_outputs=self.structured_outputs,
            )
        except GrammarError as exc:
            raise APIError(400, str(exc), param=self.guided_field()) from exc

    def guided_field(self) -> str:
        """The field that sets the request's output constraint (an error's `param`)."""
        fields = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")
        return next((name for name in fields if getattr(self, name) is not None), "response_format")

    def sampling(
        self,
        max_tokens: int,
        logprobs: int | None,
        vocab_size: int,
        prompt_logprobs: int | None = None,
        guided: GuidedSpec | None = None,
    ) -> SamplingParams:
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=self.temperature,
                top_p=self.top_p,
                top_k=self.top_k,
                min_p=self.min_p,
                seed=self.seed,
                stop=self.stops(),
                stop_token_ids=self.stop_token_id_tuple(vocab_size),
                include_stop_str_in_output=self.include_stop_str_in_output,
                ignore_eos=self.ignore_eos,
                min_tokens=self.min_tokens,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs if prompt_logprobs is not None else self.prompt_logprobs,
                presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty,
                repetition_penalty=self.repetition_penalty,
                logit_bias=self.logit_biases(vocab_size),
                skip_special_tokens=self.skip_special_tokens,
                guided=guided,
            )
        except ValueError as exc:
            raise APIError(400, str(exc)) from exc


def for_choice(sampling: SamplingParams, index: int) -> SamplingParams:
    """Choice `index` of a request: its own seed (seed + index, wrapped into 64 bits), so choices
    differ reproducibly."""
    if sampling.seed is None:
        return sampling
    return dataclasses.replace(sampling, seed=(sampling.seed + index - SEED_MIN) % 2**64 + SEED_MIN)


class CompletionRequest(CommonFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def check_supported(self) -> None:
        if (self.best_of or 1) > 1:
            raise APIError(400, "unsupported parameter: 'best_of' above 1 is not supported; use 'n'", param="best_of")
        if self.suffix:
            raise APIError(400, "unsupported parameter: 'suffix' is not supported by this server", param="suffix")
        if self.max_tokens == 0 and not self.echo:
            raise APIError(400, "max_tokens 0 is only meaningful with echo (to score the prompt)", param="max_tokens")

    def prompts(self) -> list[str | list[int]]:
        """The prompts in order: one, or several (a batch: one choice per prompt, times n)."""
        p = self.prompt
        batch = p if isinstance(p, list) and p and isinstance(p[0], (str, list)) else [p]
        for i, one in enumerate(batch):
            if not one:
                where = "the prompt" if len(batch) == 1 else f"prompt {i}"
                raise APIError(400, f"{where} is empty", param="prompt")
        return batch


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # tool_calls, tool_call_id, ... go to the template
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content: Any) -> Any:
        """Name a part this text-only server does not take, rather than the string the content
        could also have been."""
        for part in content if isinstance(content, list) else ():
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise ValueError(f"content part type {kind!r} is not supported: this server takes text parts only")
        return content

    @model_validator(mode="after")
    def _content_unless_assistant(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":  # an assistant's may be tool calls only
            raise ValueError(f"a {self.role} message needs content")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates take it: text content, and its other fields as sent."""
        message = {**(self.model_extra or {}), "role": self.role, "content": self.text()}
        return message if self.name is None else {**message, "name": self.name}


class ChatCompletionRequest(CommonFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # the chat template adds BOS itself
    chat_template_kwargs: dict[str, Any] | None = None

    def check_supported(self) -> None:
        if self.tool_choice is not None and self.tool_choice not in ("none", "auto") and not self.tools:
            raise APIError(400, "tool_choice requires tools", param="tool_choice")
        if self.tools:
            try:
                functions(self.tools)
            except ValueError as exc:
                raise APIError(400, str(exc), param="tools") from exc
        if self.continue_final_message and self.add_generation_prompt:
            raise APIError(
                400,
                "continue_final_message and add_generation_prompt cannot both be true",
                param="continue_final_message",
            )

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def requested_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(_Body):
    """vLLM's /tokenize: a prompt, or chat messages rendered through the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False

    def check_supported(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise APIError(400, "send exactly one of 'prompt' and 'messages'", param="prompt")


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]

    def check_supported(self) -> None:
        pass
