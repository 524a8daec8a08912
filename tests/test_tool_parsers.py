"""Tool-call parsers: whole outputs, streams cut anywhere, and the tool_choice schemas/grammars."""

from __future__ import annotations

import itertools
import json

import jsonschema
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from superinfer.engine.grammar import (
    JSON_LAYOUT,
    GrammarCompiler,
    GrammarMatcher,
    GuidedSpec,
    apply_bitmask,
    fill_bitmasks,
)
from superinfer.engine.model.tiny import EOT, TINY_VOCAB_SIZE, tiny_tokenizer
from superinfer.engine.serving import tool_parsers
from superinfer.engine.serving.tool_parsers import (
    ContentDelta,
    ParsedOutput,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    collect,
    detect_parser,
    get_parser,
    tool_call_schema,
)
from superinfer.engine.tokenizer import Tokenizer

HERMES = get_parser("hermes")
LLAMA3 = get_parser("llama3_json")

WEATHER = '{"city": "Paris", "days": 3, "units": {"temp": "°C"}, "note": "a } and a \\" inside"}'
HERMES_CASES: dict[str, ParsedOutput] = {
    "single": (
        '<tool_call>\n{"name": "get_weather", "arguments": ' + WEATHER + "}\n</tool_call>",
        ParsedOutput(None, [ToolCall("get_weather", WEATHER)]),
    ),
    "content_then_two_calls": (
        'Let me look.\n\n<tool_call>\n{"name": "a", "arguments": {"x": [1, 2]}}\n</tool_call>\n'
        '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>\n',
        ParsedOutput("Let me look.", [ToolCall("a", '{"x": [1, 2]}'), ToolCall("b", "{}")]),
    ),
    "arguments_first_and_no_arguments": (
        '<tool_call>{"arguments": {"q": "tea"}, "name": "search"}</tool_call><tool_call>{"name": "now"}</tool_call>',
        ParsedOutput(None, [ToolCall("search", '{"q": "tea"}'), ToolCall("now", "{}")]),
    ),
    "text_around": (
        'a <tool_call>{"name": "f", "arguments": {"s": "<tool_call>"}}</tool_call> b <tool_',
        ParsedOutput("a b <tool_", [ToolCall("f", '{"s": "<tool_call>"}')]),
    ),
    "no_call": (
        "Plain answer, with a < sign and </tool_call>.\n",
        ParsedOutput("Plain answer, with a < sign and </tool_call>.\n"),
    ),
    "not_json": (
        "<tool_call>\nget_weather(city=Paris)\n</tool_call>",
        ParsedOutput("<tool_call>\nget_weather(city=Paris)\n</tool_call>"),
    ),
    "late_broken_then_good": (
        'x <tool_call>{"name": "a", "arguments": {"k": 1}</tool_call> '
        '<tool_call>{"name": "b", "arguments": {}}</tool_call>',
        ParsedOutput('x <tool_call>{"name": "a", "arguments": {"k": 1}</tool_call>', [ToolCall("b", "{}")]),
    ),
    "garbage_after_the_object": (
        '<tool_call>{"name": "f"}  x</tool_call>',
        ParsedOutput('<tool_call>{"name": "f"}  x</tool_call>'),
    ),
    "name_not_a_string": (
        '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
        ParsedOutput('<tool_call>{"name": 3, "arguments": {}}</tool_call>'),
    ),
    "arguments_not_an_object": (
        '<tool_call>{"name": "f", "arguments": "{}"}</tool_call>',
        ParsedOutput('<tool_call>{"name": "f", "arguments": "{}"}</tool_call>'),
    ),
    "missing_close_tag": (
        '<tool_call>\n{"name": "f", "arguments": {"a": true}}\n',
        ParsedOutput(None, [ToolCall("f", '{"a": true}')]),
    ),
    "truncated": (
        'Hm <tool_call>{"name": "f", "arguments": {"a": ',
        ParsedOutput('Hm <tool_call>{"name": "f", "arguments": {"a": '),
    ),
    "empty": ("", ParsedOutput(None)),
}
LLAMA3_CASES: dict[str, tuple[str, ParsedOutput]] = {
    "single": (
        '{"name": "get_weather", "parameters": ' + WEATHER + "}",
        ParsedOutput(None, [ToolCall("get_weather", WEATHER)]),
    ),
    "python_tag_and_several": (
        '<|python_tag|>{"name": "a", "parameters": {"x": null}}; {"name": "b", "arguments": {"y": -1.5e3}};',
        ParsedOutput(None, [ToolCall("a", '{"x": null}'), ToolCall("b", '{"y": -1.5e3}')]),
    ),
    "plain_text": ("The answer is {probably} 42.", ParsedOutput("The answer is {probably} 42.")),
    "json_but_not_a_call": ('{"answer": 42, "name": "x"}', ParsedOutput('{"answer": 42, "name": "x"}')),
    "call_then_text": (
        '{"name": "a", "parameters": {}} and more',
        ParsedOutput("and more", [ToolCall("a", "{}")]),
    ),
    "broken_second_call": (
        '{"name": "a", "parameters": {}}; {"name": "b", "parameters": {]}',
        ParsedOutput('{"name": "b", "parameters": {]}', [ToolCall("a", "{}")]),
    ),
    "python_tag_other_tool": (
        '<|python_tag|>brave_search.call(query="x")',
        ParsedOutput('<|python_tag|>brave_search.call(query="x")'),
    ),
    "python_tag_alone": ("<|python_tag|>", ParsedOutput("<|python_tag|>")),
}
CASES = [(HERMES, text, want) for text, want in HERMES_CASES.values()] + [
    (LLAMA3, text, want) for text, want in LLAMA3_CASES.values()
]
IDS = [f"hermes-{k}" for k in HERMES_CASES] + [f"llama3-{k}" for k in LLAMA3_CASES]


@pytest.mark.parametrize(("parser", "text", "want"), CASES, ids=IDS)
def test_parse(parser: ToolParser, text: str, want: ParsedOutput) -> None:
    got = parser.parse(text)
    assert got == want
    for call in got.tool_calls:
        assert isinstance(json.loads(call.arguments_json), dict)


def _streamed(parser: ToolParser, pieces: list[str], truncated: bool = False) -> ParsedOutput:
    stream = parser.stream()
    events = [e for piece in pieces for e in stream.feed(piece)] + stream.finish(truncated)
    seen: set[int] = set()
    for e in events:  # OpenAI's shape: a call's first delta names it, indices count up from 0
        if isinstance(e, ToolCallDelta):
            assert (e.name is not None) == (e.index not in seen)
            assert e.index == len(seen) or e.index in seen
            seen.add(e.index)
        else:
            assert e.text
    return collect(events)


def _split(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *sorted(cuts), len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


# Streaming equals parsing the whole text wherever the text is cut, except where a call breaks
# after some of it was sent (tested below).
LATE_BREAKS = {
    "hermes-late_broken_then_good",
    "hermes-garbage_after_the_object",
    "hermes-truncated",
    "llama3-broken_second_call",
}
STREAMABLE = [case for case, name in zip(CASES, IDS, strict=True) if name not in LATE_BREAKS]
STREAMABLE_IDS = [name for name in IDS if name not in LATE_BREAKS]


@pytest.mark.parametrize(("parser", "text", "want"), STREAMABLE, ids=STREAMABLE_IDS)
def test_stream_equals_parse_at_every_cut(parser: ToolParser, text: str, want: ParsedOutput) -> None:
    assert _streamed(parser, [text]) == want
    assert _streamed(parser, list(text)) == want
    for i in range(len(text) + 1):
        assert _streamed(parser, _split(text, [i])) == want, i


@pytest.mark.parametrize(("parser", "text", "want"), STREAMABLE, ids=STREAMABLE_IDS)
def test_stream_equals_parse_in_token_pieces(parser: ToolParser, text: str, want: ParsedOutput) -> None:
    offsets = tiny_tokenizer().encode(text, add_special_tokens=False).offsets
    assert _streamed(parser, _split(text, [end for _, end in offsets])) == want


@settings(max_examples=200, deadline=None)
@given(case=st.sampled_from(STREAMABLE), data=st.data())
def test_stream_equals_parse_in_random_pieces(case: tuple, data: st.DataObject) -> None:
    parser, text, want = case
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
    assert _streamed(parser, _split(text, cuts)) == want


def test_stream_emits_arguments_as_they_arrive() -> None:
    stream = HERMES.stream()
    assert stream.feed("Sure. <tool") == [ContentDelta("Sure.")]  # the space may precede a call
    assert stream.feed('_call>{"name": "f", "argu') == []
    assert stream.feed('ments": {"a": ') == [ToolCallDelta(0, "f", '{"a": ')]
    assert stream.feed('1}}</tool_call><tool_call>{"name": "g", "arguments": {}}') == [
        ToolCallDelta(0, None, "1}"),
        ToolCallDelta(1, "g", "{}"),
    ]
    assert stream.finish() == []


def test_stream_cannot_take_back_a_call_that_breaks_late() -> None:
    # Sent as far as the arguments went; the rest of the broken call is dropped up to its close tag.
    text = '<tool_call>{"name": "f", "arguments": {"a": 1} oops}</tool_call> after'
    assert HERMES.parse(text) == ParsedOutput(text)
    cut = text.index('{"a"') + 3
    assert _streamed(HERMES, [text[:cut], text[cut:]]) == ParsedOutput(" after", [ToolCall("f", '{"a": 1}')])
    # A truncated output (max_tokens) leaves a truncated call in a stream, content in a parse.
    truncated = '<tool_call>{"name": "f", "arguments": {"a": '
    assert _streamed(HERMES, [truncated[:-3], truncated[-3:]]) == ParsedOutput(None, [ToolCall("f", '{"a": ')])
    streamed = _streamed(LLAMA3, ['{"name": "f", "parameters": {"a"', ": 1"])
    assert streamed == ParsedOutput(None, [ToolCall("f", '{"a": 1')])
    streamed = _streamed(LLAMA3, ['{"name": "f", "parameters": {"a"', ': 1} x}; {"name": "g", "parameters": {}}'])
    assert streamed == ParsedOutput(None, [ToolCall("f", '{"a": 1}')])


# What constrained decoding makes of tool_choice "required" or a named function, in each format.
FORCED = {
    "hermes": (
        HERMES,
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": [1, 2]}}\n</tool_call>',
    ),
    "llama3_json": (LLAMA3, '{"name": "get_weather", "parameters": {"city": "Oslo", "days": [1, 2]}}'),
}


@pytest.mark.parametrize(("parser", "text"), FORCED.values(), ids=FORCED)
def test_a_call_cut_by_the_length_limit_reads_the_same_whole_and_streamed(parser: ToolParser, text: str) -> None:
    """Wherever max_tokens cuts a forced call: no wrapper text ever; once the name is written, one
    call with the arguments written so far; the same whole, streamed in one piece or in two."""
    arguments = '{"city": "Oslo", "days": [1, 2]}'
    args_at = text.index(arguments)
    named_at = text.index('"get_weather"') + len('"get_weather"')
    for k in range(len(text) + 1):
        prefix = text[:k]
        whole = parser.parse(prefix, truncated=True)
        assert whole.content is None, (k, whole)
        if k < named_at:
            assert whole.tool_calls == [], k
        else:
            (call,) = whole.tool_calls
            assert call.name == "get_weather"
            assert call.arguments_json == arguments[: max(0, k - args_at)], k
        assert _streamed(parser, [prefix], truncated=True) == whole, k
        for i in range(0, k + 1, 3):
            assert _streamed(parser, _split(prefix, [i]), truncated=True) == whole, (k, i)


def test_a_cut_outside_calls_keeps_the_text_but_not_a_begun_tag() -> None:
    assert HERMES.parse("Let me check. <tool_ca", truncated=True) == ParsedOutput("Let me check. ")
    assert HERMES.parse("Let me check. <tool_ca") == ParsedOutput("Let me check. <tool_ca")
    assert HERMES.parse("a < b", truncated=True) == ParsedOutput("a < b")
    assert LLAMA3.parse("<|python", truncated=True) == ParsedOutput(None)
    assert LLAMA3.parse("The answer", truncated=True) == ParsedOutput("The answer")


def test_unknown_parser_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match="hermes, llama3_json"):
        get_parser("mistral")


# ----------------------------------------------------------------------------------------------
# tool_choice: schemas and grammars.

WEATHER_PARAMS = {
    "type": "object",
    "properties": {
        "unit": {"type": "string", "enum": ["c", "f"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["unit", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Forecast", "parameters": WEATHER_PARAMS}},
    {"type": "function", "function": {"name": "get_time"}},
]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def test_required_schema_validates_calls() -> None:
    schema = tool_call_schema(TOOLS, "required")
    jsonschema.Draft202012Validator.check_schema(schema)
    good = [{"name": "get_weather", "arguments": {"unit": "c", "days": 2}}, {"name": "get_time", "arguments": {}}]
    jsonschema.validate(good, schema)
    for bad in (
        [],
        [{"name": "get_weather", "arguments": {"unit": "k", "days": 2}}],
        [{"name": "get_time", "arguments": {"x": 1}}],
        [{"name": "nope", "arguments": {}}],
        [{"name": "get_time", "parameters": {}}],
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = tool_call_schema(TOOLS, "required", parallel=False)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(good, single)
    jsonschema.validate(good[:1], single)


def test_named_schema_validates_one_call() -> None:
    schema = tool_call_schema(TOOLS, NAMED, arguments_key="parameters")
    jsonschema.validate({"name": "get_weather", "parameters": {"unit": "f", "days": 7}}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "get_time", "parameters": {}}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "get_weather", "parameters": {"unit": "f", "days": 8}}, schema)


def test_tool_choice_errors() -> None:
    assert tool_call_schema(TOOLS, "auto") is None and tool_call_schema(None, "none") is None
    assert HERMES.guided_grammar(TOOLS, None) is None
    with pytest.raises(ValueError, match="requires tools"):
        tool_call_schema([], "required")
    with pytest.raises(ValueError, match=r"'lookup'.*get_weather, get_time"):
        tool_call_schema(TOOLS, {"type": "function", "function": {"name": "lookup"}})
    with pytest.raises(ValueError, match=r"tools\[0\].function.name"):
        tool_call_schema([{"type": "function", "function": {}}], "required")
    with pytest.raises(ValueError, match="tool_choice"):
        tool_call_schema(TOOLS, "always")


def test_json_layout_matches_structured() -> None:
    assert tool_parsers.JSON_LAYOUT == JSON_LAYOUT


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return GrammarCompiler(Tokenizer(tiny_tokenizer(), eos_token=EOT), TINY_VOCAB_SIZE)


@pytest.mark.parametrize("parser", [HERMES, LLAMA3], ids=["hermes", "llama3_json"])
@pytest.mark.parametrize("choice", ["required", NAMED], ids=["required", "named"])
def test_constrained_output_parses_with_the_same_parser(
    compiler: GrammarCompiler, parser: ToolParser, choice: object
) -> None:
    """Random logits under the family's tool_choice grammar: every output parses, with the parser
    in one piece and streamed, into calls valid for their tool."""
    grammar = compiler.compile(GuidedSpec("grammar", parser.guided_grammar(TOOLS, choice)))
    tok = Tokenizer(tiny_tokenizer(), eos_token=EOT)
    for seed in range(6):
        gen = torch.Generator().manual_seed(seed)
        matcher, ids = GrammarMatcher(grammar), []
        for _ in range(300):
            logits = torch.randn(1, TINY_VOCAB_SIZE, generator=gen)
            apply_bitmask(logits, fill_bitmasks([matcher]))
            token = int(torch.multinomial(logits.softmax(-1), 1, generator=gen))
            assert matcher.accept(token)
            if token in tok.eos_token_ids:
                break
            ids.append(token)
        else:
            pytest.fail("no EOS within 300 tokens")
        text = tok.decode(ids)
        parsed = parser.parse(text)
        pieces = [tok.decode([i]) for i in ids]  # byte-level BPE: each token decodes alone here
        assert parsed.content is None and parsed.tool_calls, text
        assert _streamed(parser, pieces) == parsed
        if choice == NAMED:
            assert [c.name for c in parsed.tool_calls] == ["get_weather"]
        for call in parsed.tool_calls:
            params = WEATHER_PARAMS if call.name == "get_weather" else {"type": "object", "maxProperties": 0}
            jsonschema.validate(json.loads(call.arguments_json), params)


DEFS_TOOLS = [
    {"type": "function", "function": {"name": "plot", "parameters": {
        "type": "object", "properties": {"at": {"$ref": "#/$defs/Point"}}, "required": ["at"],
        "$defs": {"Point": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}},
    }}},
    {"type": "function", "function": {"name": "tree", "parameters": {  # recursive, through the root
        "type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}, "maxItems": 2}},
    }}},
]  # fmt: skip


@pytest.mark.parametrize("parser", [HERMES, LLAMA3], ids=["hermes", "llama3_json"])
def test_parameters_that_refer_to_their_own_definitions_compile_and_validate(
    compiler: GrammarCompiler, parser: ToolParser
) -> None:
    """(A tool whose parameters used $defs was a 400: "Pointer '/$defs/Point' does not exist".)"""
    schema = tool_call_schema(DEFS_TOOLS, "required", arguments_key=parser.arguments_key)
    jsonschema.Draft202012Validator.check_schema(schema)
    key = parser.arguments_key
    jsonschema.validate([{"name": "plot", key: {"at": {"x": 1}}}, {"name": "tree", key: {"kids": [{}]}}], schema)
    for bad in ({"name": "plot", key: {"at": {"x": "one"}}}, {"name": "tree", key: {"kids": [{"kids": 3}]}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate([bad], schema)
    for choice in ("required", {"type": "function", "function": {"name": "plot"}}):
        compiler.compile(GuidedSpec("grammar", parser.guided_grammar(DEFS_TOOLS, choice)))


FRAGMENTS = [
    "<tool_call>", "</tool_call>", "<tool_", "<|python_tag|>", "{", "}", "[", "]", '"name"', '"arguments"',
    '"parameters"', '"f"', ":", ",", ";", " ", "\n", '"', "\\", "1", "x", "null", "é",
]  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(parts=st.lists(st.sampled_from(FRAGMENTS), max_size=30), data=st.data())
def test_any_text_parses_and_streams_without_crashing(parts: list[str], data: st.DataObject) -> None:
    text = "".join(parts)
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=8))
    for parser in (HERMES, LLAMA3):
        parsed = parser.parse(text)
        for call in [*parsed.tool_calls, *_streamed(parser, _split(text, cuts)).tool_calls]:
            assert call.name
        for call in parsed.tool_calls:
            assert isinstance(json.loads(call.arguments_json), dict)
        if not parsed.tool_calls:
            assert parsed.content == (text or None)
    if "<tool_call>" not in text:
        assert _streamed(HERMES, _split(text, cuts)) == ParsedOutput(text or None)


def test_the_parser_is_read_from_the_chat_template_then_the_family() -> None:
    renders_tools = "{% for tool in tools %}{{ tool | tojson }}{% endfor %}"
    assert detect_parser(renders_tools + "<tool_call>", "llama") == "hermes"
    assert detect_parser(renders_tools + "<|python_tag|>", "mistral") == "llama3_json"
    assert detect_parser(renders_tools, "qwen3_moe") == "hermes"
    assert detect_parser(renders_tools, "llama", "llama3") == "llama3_json"
    assert detect_parser(renders_tools, "llama") is None  # Llama 2 and other llama-shaped families
    assert detect_parser("{{ messages }} <tool_call>", "qwen3") is None  # the model never sees the tools
    assert detect_parser(None, "qwen3") is None
