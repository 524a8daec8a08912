"""What POST /v1/responses answers: the response object, whole or as its typed stream of events.

Both are read off the chat completion the request was translated into (`ChatFormat`, which
detokenizes and parses tool calls): its message becomes a `message` output item with one
`output_text` part, each tool call a `function_call` item. Streamed, each chat chunk becomes the
events that open, extend and close those items, every event numbered by `sequence_number`, and
the stream ends with `response.completed`, `response.incomplete` (the length limit) or
`response.failed` (no `[DONE]`: the Responses API has none).
"""

from __future__ import annotations

import copy
import json
import time
import uuid
from typing import Any

from superinfer.engine.output import RequestOutput
from superinfer.engine.serving.completion_bodies import ChatFormat
from superinfer.engine.serving.request_models import APIError
from superinfer.engine.serving.responses_request import ResponsesRequest

ABORTED = {"code": "server_error", "message": "the engine ended the answer before it was done (finish reason abort)"}


def ending(finish_reason: str | None) -> tuple[str, str, dict[str, Any] | None]:
    """The response's status, its last item's status and its error, for a finish reason: the length
    limit leaves it incomplete, an abort failed."""
    if finish_reason == "length":
        return "incomplete", "incomplete", None
    if finish_reason == "abort":
        return "failed", "completed", ABORTED
    return "completed", "completed", None


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(text: str, status: str) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"id": _id("msg"), "type": "message", "status": status, "role": "assistant", "content": [part]}


def call_item(call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {
        "id": _id("fc"),
        "type": "function_call",
        "status": status,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
    }


def usage(chat_usage: dict[str, Any]) -> dict[str, Any]:
    """Chat's usage in the Responses API's terms; the prompt tokens a request computes (those not
    read from the prefix cache) are the ones it writes to the cache."""
    cached = chat_usage["prompt_tokens_details"]["cached_tokens"]
    return {
        "input_tokens": chat_usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": chat_usage["prompt_tokens"] - cached},
        "output_tokens": chat_usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": chat_usage["total_tokens"],
    }


def sse_event(event: dict[str, Any]) -> bytes:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n".encode()


class ResponsesFormat:
    """The response to one /v1/responses request (one choice of a chat request)."""

    def __init__(self, chat: ChatFormat, body: ResponsesRequest, rid: str) -> None:
        self.chat, self.body, self.rid = chat, body, rid
        self.created = int(time.time())
        self.items: list[dict[str, Any]] = []  # output items so far; the last may be open
        self.open = False  # the last item is still being written
        self.finish_reason: str | None = None
        self.sequence = 0

    def response(self, status: str, error: dict[str, Any] | None = None) -> dict[str, Any]:
        body = self.body
        return {
            "id": self.rid,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "model": self.chat.model,
            "output": self.items,
            "parallel_tool_calls": body.parallel_tool_calls,
            "previous_response_id": None,
            "reasoning": None,
            "store": False,
            "temperature": body.temperature,
            "text": {"format": body.text_format()},
            "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
            "tools": body.tools or [],
            "top_p": body.top_p,
            "truncation": body.truncation,
            "usage": usage(self.chat.usage()) if status != "in_progress" else None,
            "user": body.user,
            "metadata": body.metadata or {},
        }

    # --- whole ------------------------------------------------------------------------------
    def full(self, outs: dict[int, list[RequestOutput]]) -> dict[str, Any]:
        (choice,) = self.chat.full(outs)["choices"]
        message = choice["message"]
        status, item_status, error = ending(choice["finish_reason"])
        if message["content"] or not message.get("tool_calls"):  # an empty answer is an empty message
            self.items.append(message_item(message["content"] or "", item_status))
        for call in message.get("tool_calls") or []:
            function = call["function"]
            self.items.append(call_item(call["id"], function["name"], function["arguments"], item_status))
        return self.response(status, error)

    # --- streamed ---------------------------------------------------------------------------
    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        """An event with a snapshot of `fields` (the items they show go on changing)."""
        event = {"type": kind, "sequence_number": self.sequence, **copy.deepcopy(fields)}
        self.sequence += 1
        return event

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.items[-1]["id"], "output_index": len(self.items) - 1}

    def start(self) -> list[dict[str, Any]]:
        response = self.response("in_progress")
        return [self._event(f"response.{kind}", response=response) for kind in ("created", "in_progress")]

    def events(self, index: int, out: RequestOutput) -> list[dict[str, Any]]:
        """The events one engine output makes (none while text is held back)."""
        chunk = self.chat.chunk(index, out, continuous_usage=False)
        if chunk is None:
            return []
        (choice,) = chunk["choices"]
        self.finish_reason = choice["finish_reason"] or self.finish_reason
        events = self._text(choice["delta"].get("content") or "")
        for call in choice["delta"].get("tool_calls", []):
            events += self._call(call)
        return events

    def _open(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        events = self._close("completed")
        self.items.append(item)
        self.open = True
        return [*events, self._event("response.output_item.added", output_index=len(self.items) - 1, item=item)]

    def _open_message(self) -> list[dict[str, Any]]:
        item = message_item("", "in_progress")
        part = item["content"][0]
        events = self._open({**item, "content": []})
        self.items[-1]["content"].append(part)
        return [*events, self._event("response.content_part.added", **self._where(), content_index=0, part=part)]

    def _text(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        events = []
        if not (self.open and self.items[-1]["type"] == "message"):
            events = self._open_message()
        self.items[-1]["content"][0]["text"] += text
        where = self._where()
        events.append(self._event("response.output_text.delta", **where, content_index=0, delta=text, logprobs=[]))
        return events

    def _call(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        events = []
        function = delta["function"]
        if "id" in delta:  # a call's first delta: a new item
            events = self._open(call_item(delta["id"], function["name"], "", "in_progress"))
        if arguments := function["arguments"]:
            self.items[-1]["arguments"] += arguments
            events.append(self._event("response.function_call_arguments.delta", **self._where(), delta=arguments))
        return events

    def _close(self, status: str) -> list[dict[str, Any]]:
        """Close the item being written, if any, with its `done` events."""
        if not self.open:
            return []
        self.open = False
        item = self.items[-1]
        item["status"] = status
        where = self._where()
        if item["type"] == "message":
            part = item["content"][0]
            events = [
                self._event("response.output_text.done", **where, content_index=0, text=part["text"], logprobs=[]),
                self._event("response.content_part.done", **where, content_index=0, part=part),
            ]
        else:
            args = item["arguments"]
            events = [self._event("response.function_call_arguments.done", **where, name=item["name"], arguments=args)]
        return [*events, self._event("response.output_item.done", output_index=where["output_index"], item=item)]

    def finish(self) -> list[dict[str, Any]]:
        """The open item's closing events and the terminal event."""
        status, item_status, error = ending(self.finish_reason)
        events = [] if self.items else self._open_message()  # an empty answer is an empty message
        events += self._close(item_status)
        return [*events, self._event(f"response.{status}", response=self.response(status, error))]

    def fail(self, err: APIError) -> list[dict[str, Any]]:
        """The stream broke after the status line went out (the engine failed)."""
        events = self._close("incomplete")
        response = self.response("failed", {"code": "server_error", "message": err.message})
        return [*events, self._event("response.failed", response=response)]
