"""Tool calls in generated text, per model family (`--tool-call-parser`).

- `hermes` (Qwen2.5, Qwen3, Hermes): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
  one or more; text before them is content.
- `llama3_json` (Llama 3.x): the whole output is `{"name": ..., "parameters": {...}}`, several
  separated by `;`, maybe after `<|python_tag|>` (decode with special tokens kept to see it).

`parse` is for whole outputs; `stream()` gives a parser fed the decoded deltas that emits content
and tool-call deltas (index, the name once, argument fragments) the way OpenAI streams
`delta.tool_calls`, holding back text that may be the start of a tool call. A call's
`arguments_json` is the arguments object as the model wrote it, so the streamed fragments add up
to it exactly. A tool call whose JSON is invalid stays content, with one limit in streaming:
arguments are streamed as they arrive, so a call that breaks after some of them went out cannot
be taken back; it stays a call with what was sent (all of its arguments if they were complete),
and the rest of it (hermes: up to its close tag; llama3_json: the rest of the output) is dropped.
An output the length limit cut inside a call is read the same way whole and streamed: a named call
keeps the arguments written so far (OpenAI's `finish_reason: "length"` with partial arguments), a
call cut before its name is dropped, and no part of the wrapper is ever content.

`tool_call_schema` is the JSON schema of the calls that `tool_choice` ("required" or a named
function) demands; `ToolParser.guided_grammar` wraps it in the family's own format (a Lark grammar
for llguidance), so that constrained output is parsed, and streamed, by the same parser.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from superinfer.engine.output_constraint import JSON_LAYOUT

_WS = " \t\r\n"
_STRING_RUN = re.compile(r'[^"\\]+')
NAME_KEY = "name"
ARGUMENT_KEYS = ("arguments", "parameters")


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments_json: str


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of call `index`: its first delta carries the name, every delta an arguments fragment."""

    index: int
    name: str | None = None
    arguments: str = ""


DeltaEvent = ContentDelta | ToolCallDelta


class _CallScanner:
    """Scans one call's JSON object as its text arrives: reads the name and locates the arguments
    value, so that the arguments can be streamed before the object is complete. Each top-level
    value is checked with json.loads once it ends; `error` is final."""

    def __init__(self, require_arguments: bool) -> None:
        self.text = ""
        self.name: str | None = None
        self.done = False
        self.error = False
        self._require_arguments = require_arguments
        self._args_start: int | None = None
        self._args_end: int | None = None
        self._pos = 0
        self._state = "open"
        self._key = ""
        self._keys: set[str] = set()
        self._start = 0  # of the current key or value
        self._depth = 0
        self._in_string = False
        self._escape = False

    def push(self, chunk: str) -> str:
        """Scan `chunk`; return the text after the object's closing brace (once done)."""
        self.text += chunk
        while self._pos < len(self.text) and not (self.done or self.error):
            self._step()
        if not self.done:
            return ""
        rest, self.text = self.text[self._pos :], self.text[: self._pos]
        return rest

    def can_commit(self) -> bool:
        """Named, and the arguments have begun (or the object ended without any)."""
        return not self.error and self.name is not None and (self._args_start is not None or self.done)

    def arguments(self) -> str:
        """The arguments' text scanned so far."""
        if self._args_start is None:
            return "{}" if self.done else ""
        return self.text[self._args_start : self._args_end if self._args_end is not None else self._pos]

    def arguments_complete(self) -> bool:
        return self._args_end is not None

    def unscanned(self) -> str:
        """After an error: the text from where it was found on."""
        return self.text[self._pos :]

    def _fail(self) -> None:
        self.error = True

    def _step(self) -> None:
        state = self._state
        if state == "key":
            if self._scan_string():
                self._end_key()
            return
        if state == "value":
            self._scan_value()
            return
        c = self.text[self._pos]
        self._pos += 1
        if c in _WS:
            pass
        elif state == "open" and c == "{":
            self._state = "first_key"
        elif state in ("first_key", "next_key") and c == '"':
            self._start, self._state = self._pos - 1, "key"
        elif state in ("first_key", "after_value") and c == "}":
            self._end_object()
        elif state == "colon" and c == ":":
            self._state = "before_value"
        elif state == "after_value" and c == ",":
            self._state = "next_key"
        elif state == "before_value":
            self._begin_value(c)  # whatever it is: json.loads judges the value
        else:
            self._pos -= 1
            self._fail()

    def _scan_string(self) -> bool:
        """Advance inside a string; True once past its closing quote."""
        text = self.text
        while self._pos < len(text):
            if self._escape:
                self._escape = False
                self._pos += 1
            elif m := _STRING_RUN.match(text, self._pos):
                self._pos = m.end()
            else:
                self._pos += 1
                if text[self._pos - 1] == '"':
                    return True
                self._escape = True
        return False

    def _end_key(self) -> None:
        try:
            key = json.loads(self.text[self._start : self._pos])
        except ValueError:
            self._fail()
            return
        duplicate = key in self._keys or (key in ARGUMENT_KEYS and self._keys.intersection(ARGUMENT_KEYS))
        if duplicate:
            self._fail()
            return
        self._keys.add(key)
        self._key = key
        self._state = "colon"

    def _begin_value(self, c: str) -> None:
        self._start = self._pos - 1
        self._state = "value"
        self._depth = 1 if c in "{[" else 0
        self._in_string = c == '"'
        if self._key in ARGUMENT_KEYS:
            if c != "{":
                self._pos -= 1
                self._fail()
            self._args_start = self._start

    def _scan_value(self) -> None:
        if self._in_string:
            if self._scan_string():
                self._in_string = False
                if self._depth == 0:
                    self._end_value()
            return
        c = self.text[self._pos]
        if self._depth == 0:  # a number, true, false or null: ends before a delimiter
            if c in _WS or c in ",}":
                self._end_value()
            else:
                self._pos += 1
            return
        self._pos += 1
        if c == '"':
            self._in_string = True
        elif c in "{[":
            self._depth += 1
        elif c in "}]":
            self._depth -= 1
            if self._depth == 0:
                self._end_value()

    def _end_value(self) -> None:
        try:
            value = json.loads(self.text[self._start : self._pos])
        except ValueError:
            self._fail()
            return
        if self._key == NAME_KEY and not isinstance(value, str):
            self._fail()
        elif self._key == NAME_KEY:
            self.name = value
        elif self._key in ARGUMENT_KEYS:
            self._args_end = self._pos
        self._state = "after_value"

    def _end_object(self) -> None:
        if self.name is None or (self._require_arguments and self._args_start is None):
            self._fail()
        else:
            self.done = True


class ToolCallStream(ABC):
    """Incremental parser: `feed` each decoded delta, `finish` at the end of the output.

    Events of the current call are produced as soon as the call is certain enough (named, and
    its arguments begun); until a feed returns them, a call that turns out invalid is turned back
    into content. `ToolParser.parse` is `complete(text)`, so it validates every call whole.
    """

    _require_arguments: ClassVar[bool]

    def __init__(self) -> None:
        self._out: list[DeltaEvent] = []
        self._calls = 0
        self._scanner: _CallScanner | None = None
        self._index: int | None = None  # of the call being scanned, once committed
        self._released = False  # some of its events were returned: it can no longer be undone
        self._mark = 0  # where its events start in _out
        self._sent = 0  # arguments characters emitted

    def feed(self, delta: str) -> list[DeltaEvent]:
        self._out, self._mark = [], 0
        self._consume(delta)
        return self._release()

    def finish(self, truncated: bool = False) -> list[DeltaEvent]:
        """The output ended; `truncated`: by the length limit, so a call may be cut off."""
        self._out, self._mark = [], 0
        self._close(truncated)
        return self._release()

    def complete(self, text: str, truncated: bool = False) -> list[DeltaEvent]:
        """`feed(text)` and `finish(truncated)` as one step: nothing goes out before the end, so
        every call is validated whole (what `ToolParser.parse` does)."""
        self._out, self._mark = [], 0
        self._consume(text)
        self._close(truncated)
        return self._release()

    @abstractmethod
    def _consume(self, text: str) -> None: ...

    @abstractmethod
    def _close(self, truncated: bool) -> None: ...

    def _release(self) -> list[DeltaEvent]:
        if self._index is not None:
            self._released = True
        return _merged(self._out)

    def _content(self, text: str) -> None:
        if text:
            self._out.append(ContentDelta(text))

    def _begin_call(self) -> None:
        self._scanner = _CallScanner(self._require_arguments)
        self._index, self._released, self._mark, self._sent = None, False, len(self._out), 0

    def _push(self, text: str) -> str:
        """Scan more of the current call, emit what became certain; return the text after it."""
        scanner = self._scanner
        assert scanner is not None
        rest = scanner.push(text)
        if scanner.error:
            if self._released and scanner.arguments_complete():
                self._send_arguments()  # what broke came after them
            return rest
        if self._index is None and scanner.can_commit():
            self._commit()
        if self._index is not None:
            self._send_arguments()
        return rest

    def _commit(self) -> None:
        """The current call is certain: it gets the next index, and its name goes out."""
        assert self._scanner is not None
        self._index, self._calls = self._calls, self._calls + 1
        self._out.append(ToolCallDelta(self._index, name=self._scanner.name))

    def _send_arguments(self) -> None:
        assert self._scanner is not None and self._index is not None
        fragment = self._scanner.arguments()[self._sent :]
        if fragment:
            self._out.append(ToolCallDelta(self._index, arguments=fragment))
            self._sent += len(fragment)

    def _cut_call(self) -> None:
        """The length limit cut the current call off. As OpenAI reports it, a named call stands
        with the arguments written so far; one cut before its name is dropped. Either way none of
        its wrapper becomes content."""
        scanner = self._scanner
        assert scanner is not None
        if scanner.name is None:
            self._undo_call()
            return
        if self._index is None:
            self._commit()
        self._send_arguments()

    def _undo_call(self) -> bool:
        """Take the failed call back if nothing of it went out yet (True: its text is content)."""
        if self._released:
            return False
        del self._out[self._mark :]
        if self._index is not None:
            self._calls -= 1
            self._index = None
        return True


def _merged(events: list[DeltaEvent]) -> list[DeltaEvent]:
    """Adjacent content deltas, and adjacent deltas of one call, joined."""
    out: list[DeltaEvent] = []
    for e in events:
        last = out[-1] if out else None
        if isinstance(e, ContentDelta) and isinstance(last, ContentDelta):
            out[-1] = ContentDelta(last.text + e.text)
        elif isinstance(e, ToolCallDelta) and isinstance(last, ToolCallDelta) and last.index == e.index:
            out[-1] = ToolCallDelta(e.index, last.name or e.name, last.arguments + e.arguments)
        else:
            out.append(e)
    return out


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class HermesStream(ToolCallStream):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    _require_arguments = False

    def __init__(self) -> None:
        super().__init__()
        self._state = "text"  # text | call | after (the object, before the close tag) | skip
        self._buf = ""  # held back: whitespace and a partial tag
        self._after_call = False  # only whitespace since a call: dropped unless text follows
        self._ws_before = ""  # whitespace before the open tag, dropped only if the call stands

    def _consume(self, text: str) -> None:
        while text or self._state == "text":
            if self._state == "text":
                text = self._in_text(text)
                if self._state == "text":
                    return
            elif self._state == "call":
                text = self._push(text)
                if self._scanner.error:
                    text = self._failed(text)
                elif self._scanner.done:
                    self._state = "after"
                else:
                    return
            elif self._state == "after":
                text = self._in_after(text)
            else:
                text = self._in_skip(text)

    def _in_text(self, text: str) -> str:
        buf = self._buf + text
        start = buf.find(self.OPEN)
        if start < 0:
            if self._after_call and not buf.strip(_WS):
                self._buf = buf  # dropped if another call or the end comes first
                return ""
            self._after_call = False
            body = buf[: len(buf) - _partial_suffix(buf, self.OPEN)]
            kept = len(body.rstrip(_WS))  # whitespace before a call is dropped: hold it back
            self._content(body[:kept])
            self._buf = buf[kept:]
            return ""
        before = buf[:start]
        kept = len(before.rstrip(_WS))
        self._content(before[:kept])
        self._ws_before, self._buf = before[kept:], ""
        self._begin_call()
        self._state = "call"
        return buf[start + len(self.OPEN) :]

    def _in_after(self, text: str) -> str:
        raw = self._buf + text
        buf = raw.lstrip(_WS)
        if buf.startswith(self.CLOSE):
            self._state, self._buf, self._after_call = "text", "", True
            return buf[len(self.CLOSE) :]
        if self.CLOSE.startswith(buf):
            self._buf = raw
            return ""
        self._buf = ""
        return self._failed(raw)

    def _in_skip(self, text: str) -> str:
        buf = self._buf + text
        end = buf.find(self.CLOSE)
        if end < 0:
            self._buf = buf[len(buf) - _partial_suffix(buf, self.CLOSE) :]
            return ""
        self._state, self._buf, self._after_call = "text", "", True
        return buf[end + len(self.CLOSE) :]

    def _failed(self, rest: str) -> str:
        """The call in progress is invalid: its text becomes content (scanned again for tags), or,
        if it was partly sent, the rest of it up to the close tag is dropped."""
        assert self._scanner is not None
        if not self._undo_call():
            self._state = "skip"
            return self._scanner.unscanned() + rest
        self._content(self._ws_before + self.OPEN)
        self._state, self._after_call = "text", False
        return self._scanner.text + rest

    def _close(self, truncated: bool) -> None:
        # In "after", the object is complete and at most part of the close tag is missing: it stands.
        if self._state == "call" and truncated:
            self._cut_call()
        elif self._state == "call":
            self._consume(self._failed(""))
            self._close(truncated)
        elif self._state == "text" and not self._after_call:
            cut = _partial_suffix(self._buf, self.OPEN) if truncated else 0  # an open tag begun
            self._content(self._buf[: len(self._buf) - cut])
            self._buf = ""


class Llama3Stream(ToolCallStream):
    TAG = "<|python_tag|>"
    _require_arguments = True

    def __init__(self) -> None:
        super().__init__()
        self._state = "start"  # start | call | between | content | dropped
        self._buf = ""  # held back before a call: whitespace, the tag, ';'
        self._raw = ""  # text before the current call, content if the call fails

    def _consume(self, text: str) -> None:
        while text and self._state != "dropped":
            if self._state == "content":
                self._content(text)
                return
            if self._state == "call":
                text = self._push(text)
                if self._scanner.error:
                    self._failed(text)
                    return
                if not self._scanner.done:
                    return
                self._state = "between"
            else:
                text = self._before_call(text)

    def _before_call(self, text: str) -> str:
        buf = self._buf + text
        rest = buf.lstrip(_WS)
        if self._state == "start" and rest.startswith(self.TAG):
            rest = rest[len(self.TAG) :].lstrip(_WS)
        elif self._state == "between" and rest.startswith(";"):
            rest = rest[1:].lstrip(_WS)
        elif self._state == "between" and rest:
            self._state = "content"  # text after the calls
            return rest
        waiting = rest == "" or (self._state == "start" and self.TAG.startswith(rest))
        if waiting:
            self._buf = buf
            return ""
        if not rest.startswith("{"):
            whole = self._state == "start"
            self._state = "content"
            return buf if whole else rest
        self._raw, self._buf = buf[: len(buf) - len(rest)], ""
        self._begin_call()
        self._state = "call"
        return rest

    def _failed(self, rest: str) -> None:
        assert self._scanner is not None
        raw = self._raw + self._scanner.text + rest
        if not self._undo_call():
            self._state = "dropped"  # no close tag tells where the broken call ends
            return
        self._state = "content"
        self._content(raw if self._calls == 0 else raw.lstrip(_WS + ";"))

    def _close(self, truncated: bool) -> None:
        if self._state == "call" and not self._scanner.done:
            if truncated:
                self._cut_call()
            else:
                self._failed("")
        elif self._state == "start" and not (truncated and self.TAG.startswith(self._buf.strip(_WS))):
            self._content(self._buf)


class ToolParser(ABC):
    name: ClassVar[str]
    arguments_key: ClassVar[str]  # the key this family's models write the arguments under

    @abstractmethod
    def stream(self) -> ToolCallStream: ...

    @abstractmethod
    def _grammar(self, call_schema: dict[str, Any], repeat: bool) -> str: ...

    def parse(self, text: str, truncated: bool = False) -> ParsedOutput:
        return collect(self.stream().complete(text, truncated))

    def guided_grammar(
        self, tools: Sequence[Mapping[str, Any]] | None, tool_choice: Any, parallel: bool = True
    ) -> str | None:
        """Lark grammar (llguidance) that makes the model call the tool(s) `tool_choice` demands,
        in this family's format; None unless tool_choice is "required" or names a function."""
        schema = tool_call_schema(tools, tool_choice, arguments_key=self.arguments_key, parallel=parallel)
        if schema is None:
            return None
        repeat = schema.get("type") == "array" and parallel
        call = schema["items"] if schema.get("type") == "array" else schema
        if "$defs" in schema:  # the calls' parameters refer to them from the grammar's root
            call = {**call, "$defs": schema["$defs"]}
        return self._grammar({"x-guidance": JSON_LAYOUT, **call}, repeat)


class HermesParser(ToolParser):
    name = "hermes"
    arguments_key = "arguments"

    def stream(self) -> ToolCallStream:
        return HermesStream()

    def _grammar(self, call_schema: dict[str, Any], repeat: bool) -> str:
        more = ' ("\\n" call)*' if repeat else ""
        return (
            f"start: call{more}\n"
            'call: "<tool_call>\\n" body "\\n</tool_call>"\n'
            f"body: %json {json.dumps(call_schema, ensure_ascii=False)}\n"
        )


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    arguments_key = "parameters"

    def stream(self) -> ToolCallStream:
        return Llama3Stream()

    def _grammar(self, call_schema: dict[str, Any], repeat: bool) -> str:
        more = ' ("; " body)*' if repeat else ""
        return f"start: body{more}\nbody: %json {json.dumps(call_schema, ensure_ascii=False)}\n"


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser)}


def get_parser(name: str) -> ToolParser:
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(sorted(PARSERS))}")
    return PARSERS[name]()


def detect_parser(chat_template: str | None, architecture: str, rope_type: str | None = None) -> str | None:
    """The parser for a model served without `--tool-call-parser`: from the markup its chat
    template writes tool calls in, else from its family (Qwen: hermes; Llama 3.x, whose RoPE is
    `llama3`: llama3_json); None when the template cannot show the model any tools."""
    if not chat_template or "tools" not in chat_template:
        return None
    if HermesStream.OPEN in chat_template:
        return HermesParser.name
    if Llama3Stream.TAG in chat_template:
        return Llama3JsonParser.name
    if architecture.startswith("qwen"):
        return HermesParser.name
    if architecture == "llama" and rope_type == "llama3":
        return Llama3JsonParser.name
    return None


def collect(events: Sequence[DeltaEvent]) -> ParsedOutput:
    """Fold a stream's events into the whole output."""
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    names: dict[int, str] = {}
    arguments: dict[int, list[str]] = {}
    for e in events:
        if isinstance(e, ToolCallDelta):
            if e.name is not None:
                names[e.index] = e.name
            arguments.setdefault(e.index, []).append(e.arguments)
    calls = [ToolCall(names[i], "".join(arguments[i])) for i in sorted(names)]
    return ParsedOutput(content or None, calls)


# ----------------------------------------------------------------------------------------------
# tool_choice -> JSON schema of the calls.


def functions(tools: Sequence[Mapping[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """Function name -> parameters schema, from OpenAI `tools`."""
    if not tools:
        raise ValueError("tool_choice requires tools")
    out: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(tool, Mapping) or tool.get("type", "function") != "function" or not isinstance(fn, Mapping):
            raise ValueError(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"tools[{i}].function.name must be a non-empty string")
        params = fn.get("parameters")
        if params is None:  # a function without parameters takes an empty object
            params = {"type": "object", "properties": {}, "additionalProperties": False}
        if not isinstance(params, Mapping):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
        out[name] = dict(params)
    return out


def _call_schema(name: str, parameters: dict[str, Any], arguments_key: str, defs: dict[str, Any]) -> dict[str, Any]:
    """A call of `name`. Parameters that refer to their own parts ("$ref": "#/$defs/...") go into
    `defs` (the $defs of the document's root), their local references rebased there: as a
    property they would resolve against the root."""
    if _has_local_ref(parameters):
        key = f"parameters{len(defs)}"
        defs[key] = _rebase_refs(parameters, f"#/$defs/{key}")
        parameters = {"$ref": f"#/$defs/{key}"}
    return {
        "type": "object",
        "properties": {NAME_KEY: {"type": "string", "enum": [name]}, arguments_key: parameters},
        "required": [NAME_KEY, arguments_key],
        "additionalProperties": False,
    }


def _has_local_ref(node: Any) -> bool:
    if isinstance(node, Mapping):
        ref = node.get("$ref")
        return (isinstance(ref, str) and ref.startswith("#")) or any(_has_local_ref(v) for v in node.values())
    return isinstance(node, list) and any(_has_local_ref(v) for v in node)


def _rebase_refs(node: Any, base: str) -> Any:
    """`node` with each local "$ref": "#<pointer>" turned into "<base><pointer>"."""
    if isinstance(node, Mapping):
        out = {k: _rebase_refs(v, base) for k, v in node.items()}
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            out["$ref"] = base + ref[1:]
        return out
    if isinstance(node, list):
        return [_rebase_refs(v, base) for v in node]
    return node


def tool_call_schema(
    tools: Sequence[Mapping[str, Any]] | None,
    tool_choice: Any,
    *,
    arguments_key: str = "arguments",
    parallel: bool = True,
) -> dict[str, Any] | None:
    """JSON schema of the output `tool_choice` demands: "required" -> an array of one or more
    calls (at most one unless `parallel`) of any of the tools; {"type": "function", "function":
    {"name": ...}} -> one call of that function; "none", "auto" or None -> None (unconstrained).
    A call is {"name": <function>, <arguments_key>: <its parameters>}."""
    if tool_choice in (None, "none", "auto"):
        return None
    params = functions(tools)
    defs: dict[str, Any] = {}
    if tool_choice == "required":
        calls = [_call_schema(n, p, arguments_key, defs) for n, p in params.items()]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not parallel:
            schema["maxItems"] = 1
    else:
        fn = tool_choice.get("function") if isinstance(tool_choice, Mapping) else None
        name = fn.get("name") if isinstance(fn, Mapping) else None
        if not isinstance(name, str):
            raise ValueError(
                "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name'}}"
            )
        if name not in params:
            raise ValueError(f"tool_choice names function {name!r}, which is not among the tools ({', '.join(params)})")
        schema = _call_schema(name, params[name], arguments_key, defs)
    return schema | {"$defs": defs} if defs else schema
