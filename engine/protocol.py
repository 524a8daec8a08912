"""OpenAI-compatible request bodies, and the conversion to SamplingParams.

Unknown fields are rejected by name (as OpenAI does); known fields we do not implement are
accepted only at their neutral value, otherwise the error names them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from superinfer.engine.core.request import SamplingParams


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


class SLOField(BaseModel):
    model_config = ConfigDict(extra="forbid")
    ttft_ms: float | None = Field(None, gt=0)
    tbt_ms: float | None = Field(None, gt=0)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1)
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    slo_class: str | None = None
    slo: SLOField | None = None
    priority: int | None = None  # None: the SLO class's priority

    def _unsupported(self) -> dict[str, bool]:
        return {
            "n": self.n != 1,
            "presence_penalty": self.presence_penalty != 0,
            "frequency_penalty": self.frequency_penalty != 0,
            "logit_bias": bool(self.logit_bias),
        }

    def check_supported(self) -> None:
        for name, used in self._unsupported().items():
            if used:
                raise APIError(400, f"unsupported parameter: {name!r} is not supported by this server", param=name)

    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if any(not s for s in stops):
            raise APIError(400, "stop strings must not be empty", param="stop")
        return stops

    def sampling(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=self.temperature,
                top_p=self.top_p,
                top_k=self.top_k,
                seed=self.seed,
                stop=self.stops(),
                stop_token_ids=tuple(self.stop_token_ids or ()),
                ignore_eos=self.ignore_eos,
                min_tokens=self.min_tokens,
                logprobs=logprobs,
            )
        except ValueError as exc:
            raise APIError(400, str(exc)) from exc


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def _unsupported(self) -> dict[str, bool]:
        return {
            **super()._unsupported(),
            "echo": self.echo,
            "best_of": self.best_of not in (None, 1),
            "suffix": bool(self.suffix),
        }

    def single_prompt(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise APIError(
                    400,
                    "unsupported parameter: batched prompts (a list of several prompts) "
                    "are not supported; send one request per prompt",
                    param="prompt",
                )
            p = p[0]
        if not p:
            raise APIError(400, "the prompt is empty", param="prompt")
        return p


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: ResponseFormat | None = None
    parallel_tool_calls: bool | None = None

    def _unsupported(self) -> dict[str, bool]:
        return {
            **super()._unsupported(),
            "tools": bool(self.tools),
            "tool_choice": self.tool_choice not in (None, "none", "auto"),
            "response_format": self.response_format is not None and self.response_format.type != "text",
        }

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def requested_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None
