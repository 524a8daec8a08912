"""The body of POST /v1/responses, and its translation into a chat completion request.

The Responses API asks for what chat completions do in another shape: `input` items instead of
messages, flat function tools, `text.format` instead of `response_format`, `max_output_tokens`.
Translating the body lets one pipeline render the chat template, sample, constrain and parse tool
calls for both endpoints. This server keeps no state: `store` and `previous_response_id` are
refused, and a client continues a conversation by sending the earlier output items back as input.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from superinfer.engine.serving.request_models import APIError, CommonFields

MESSAGE_ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")
MAX_METADATA_KEYS = 16  # as OpenAI bounds it

# Chat's name for a field -> the name the Responses body gave it (for the `param` of an error).
RESPONSES_PARAMS = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
}


class ResponsesRequest(CommonFields):
    """OpenAI's fields, plus the sampling and SLO extras every endpoint here takes (top_k, seed,
    stop, ignore_eos, slo_class, slo, priority, ...)."""

    input: str | list[Any]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    background: bool = False
    include: list[str] | None = None
    truncation: Literal["auto", "disabled"] = "disabled"
    reasoning: dict[str, Any] | None = None  # for reasoning models; this server runs none: unused
    top_logprobs: int | None = None
    service_tier: str | None = None  # accepted, as every request is served the same way
    prompt_cache_key: str | None = None  # prefix caching is automatic here: unused
    safety_identifier: str | None = None

    def check_supported(self) -> None:
        stateless = "this server keeps no responses: send the earlier output items as input"
        refused = {
            "store": (self.store, stateless + ", and store: false"),
            "previous_response_id": (self.previous_response_id, stateless),
            "conversation": (self.conversation, stateless),
            "background": (self.background, "it is polled for later, and this server keeps no responses"),
            "include": (self.include, "this server adds nothing to the output on request"),
            "top_logprobs": (self.top_logprobs, "logprobs are served on /v1/chat/completions"),
            "response_format": (self.response_format, "on /v1/responses the output format is text.format"),
        }
        for field, (value, why) in refused.items():
            if value:
                raise APIError(400, f"unsupported parameter {field!r}: {why}", param=field)
        if self.n != 1:
            raise APIError(400, "/v1/responses makes one output; use /v1/chat/completions for n > 1", param="n")
        if self.truncation == "auto":
            why = "truncation 'auto' is not supported: an input too long for the context is an error"
            raise APIError(400, why, param="truncation")
        if self.metadata is not None and len(self.metadata) > MAX_METADATA_KEYS:
            raise APIError(400, f"metadata holds at most {MAX_METADATA_KEYS} keys", param="metadata")

    def text_format(self) -> dict[str, Any]:
        return (self.text or {}).get("format") or {"type": "text"}

    def to_chat(self) -> dict[str, Any]:
        """The chat completion request body that asks for the same output."""
        common = self.model_dump(include=set(CommonFields.model_fields) & self.model_fields_set)
        chat: dict[str, Any] = {
            **common,
            "messages": chat_messages(self.instructions, self.input),
            "max_completion_tokens": self.max_output_tokens,
            "parallel_tool_calls": self.parallel_tool_calls,
            "response_format": response_format(self.text_format()),
        }
        if self.tools:
            chat["tools"] = [chat_tool(tool, i) for i, tool in enumerate(self.tools)]
        if self.tool_choice is not None:
            chat["tool_choice"] = chat_tool_choice(self.tool_choice)
        return chat


def _field(item: dict[str, Any], key: str, where: str, kind: type = str) -> Any:
    value = item.get(key)
    if not isinstance(value, kind):
        raise APIError(400, f"{where}.{key} must be a {kind.__name__}", param=f"{where}.{key}")
    return value


def _text(content: Any, where: str) -> str:
    """A message's text: a string, or text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}.content must be a string or a list of text parts", param=f"{where}.content")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise APIError(
                400,
                f"content part type {kind!r} is not supported: this server takes text parts ({', '.join(TEXT_PARTS)})",
                param=f"{where}.content[{j}]",
            )
        texts.append(part["text"])
    return "".join(texts)


def chat_messages(instructions: str | None, input: str | list[Any]) -> list[dict[str, Any]]:
    """`instructions` as a system message, then the input items as chat messages: a function
    call joins the assistant message before it (as chat's `tool_calls`), its output is a tool message."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    if isinstance(input, str):
        return [*messages, {"role": "user", "content": input}]
    if not input:
        raise APIError(400, "input must not be empty", param="input")
    for i, item in enumerate(input):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise APIError(400, f"{where} must be an object", param=where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in MESSAGE_ROLES:
                raise APIError(400, f"{where}.role must be one of {', '.join(MESSAGE_ROLES)}", param=f"{where}.role")
            messages.append({"role": role, "content": _text(item.get("content"), where)})
        elif kind == "function_call":
            function = {"name": _field(item, "name", where), "arguments": _field(item, "arguments", where)}
            call = {"id": _field(item, "call_id", where), "type": "function", "function": function}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            content = output if isinstance(output, str) else _text(output, f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": _field(item, "call_id", where), "content": content})
        else:
            raise APIError(
                400,
                f"input item type {kind!r} is not supported: this server takes message, function_call and "
                "function_call_output items",
                param=f"{where}.type",
            )
    return messages


def chat_tool(tool: dict[str, Any], i: int) -> dict[str, Any]:
    """A Responses function tool (flat) as chat's ({"type": "function", "function": {...}})."""
    if tool.get("type") != "function":
        why = f"tool type {tool.get('type')!r} is not supported: this server runs function tools"
        raise APIError(400, why, param=f"tools[{i}]")
    _field(tool, "name", f"tools[{i}]")
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
    return {"type": "function", "function": function}


def chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise APIError(
        400, "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}", param="tool_choice"
    )


def response_format(text_format: dict[str, Any]) -> dict[str, Any] | None:
    """`text.format` as chat's `response_format`."""
    kind = text_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        schema = {k: text_format[k] for k in ("name", "schema", "strict", "description") if k in text_format}
        return {"type": "json_schema", "json_schema": schema}
    raise APIError(400, "text.format.type must be 'text', 'json_object' or 'json_schema'", param="text.format.type")
