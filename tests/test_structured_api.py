"""Structured output and tool calls over HTTP with the random-weight tiny model: whatever the model
would say, a finished constrained answer always parses and validates."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
import pytest_asyncio

from superinfer.engine.config import EngineConfig
from superinfer.engine.output import RequestOutput
from superinfer.engine.serving.completion_bodies import ChatFormat, ChoiceSpec
from superinfer.engine.serving.server import start_server
from superinfer.engine.serving.tool_parsers import get_parser
from tests.test_openai_api import post, stream
from tests.test_server import MODEL

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
        "sunny": {"type": "boolean"},
        "days": {"type": "integer", "minimum": 0, "maximum": 30},
    },
    "required": ["city", "sunny", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}, "celsius": {"type": "boolean"}},
                "required": ["city", "celsius"],
                "additionalProperties": False,
            },
        },
    },
    {"type": "function", "function": {"name": "get_time"}},
]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Weather?"}], "max_tokens": 200, "seed": 3}


# One server per scheduling mode for the module (its tests only send requests), on the module's loop.
ON_THE_MODULE_LOOP = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=[False, True], ids=["sync", "async-scheduling"])
async def server(request):
    """The tiny model with room for tool listings in the prompt (the shared fixture has 256 tokens)."""
    running = await start_server(
        EngineConfig(
            model="tiny",
            served_model_name=MODEL,
            device="cpu",
            port=0,
            max_model_len=1024,
            async_scheduling=request.param,
        )
    )
    yield running
    await running.close()


@pytest_asyncio.fixture(loop_scope="module")
async def client(server):
    async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as cl:
        yield cl


@ON_THE_MODULE_LOOP
async def test_json_schema_answers_always_validate(server):
    body = {**CHAT, "n": 4, "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}}
    status, done = await post(server, "/v1/chat/completions", body)
    assert status == 200, done
    for choice in done["choices"]:
        assert choice["finish_reason"] == "stop"
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
    chunks = await stream(server, "/v1/chat/completions", {**body, "n": 1})
    text = "".join(ch["delta"].get("content", "") for chunk in chunks for ch in chunk["choices"])
    jsonschema.validate(json.loads(text), SCHEMA)


@ON_THE_MODULE_LOOP
async def test_vllm_guided_fields_on_completions(server):
    base = {"model": MODEL, "prompt": "Answer:", "max_tokens": 60, "seed": 1, "n": 3}
    status, done = await post(server, "/v1/completions", {**base, "guided_choice": ["yes", "no", "maybe"]})
    assert status == 200 and {ch["text"] for ch in done["choices"]} <= {"yes", "no", "maybe"}
    status, done = await post(server, "/v1/completions", {**base, "guided_regex": r"[0-9]{3}-[a-z]{2}"})
    assert status == 200
    assert all(re.fullmatch(r"[0-9]{3}-[a-z]{2}", ch["text"]) for ch in done["choices"])
    status, done = await post(server, "/v1/completions", {**base, "structured_outputs": {"json": SCHEMA}})
    assert status == 200
    for choice in done["choices"]:
        jsonschema.validate(json.loads(choice["text"]), SCHEMA)


@ON_THE_MODULE_LOOP
async def test_a_schema_the_engine_cannot_follow_is_a_400(server):
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": 5}}}
    status, err = await post(server, "/v1/chat/completions", {**CHAT, "response_format": bad})
    assert status == 400 and err["error"]["param"] == "response_format" and "json_schema" in err["error"]["message"]
    # Compiles, but no text satisfies it: it had answered "" with finish_reason "stop".
    only_itself = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": only_itself}}
    status, err = await post(server, "/v1/chat/completions", {**CHAT, "response_format": bad})
    assert status == 400 and "no output can satisfy it" in err["error"]["message"]
    status, err = await post(server, "/v1/chat/completions", {**CHAT, "response_format": {"type": "yaml"}})
    assert status == 400 and "response_format.type" in err["error"]["message"]
    both = {**CHAT, "guided_regex": "a+", "response_format": {"type": "json_object"}}
    status, err = await post(server, "/v1/chat/completions", both)
    assert status == 400 and "only one" in err["error"]["message"]
    status, err = await post(server, "/v1/chat/completions", {**CHAT, "guided_regex": "a+", "min_tokens": 3})
    assert status == 400 and "min_tokens" in err["error"]["message"]


@ON_THE_MODULE_LOOP
async def test_ignore_eos_runs_past_the_grammars_end_on_eos_only(server):
    body = {"model": MODEL, "prompt": "x", "guided_choice": ["yes", "no"], "max_tokens": 12, "ignore_eos": True}
    status, done = await post(server, "/v1/completions", body)
    assert status == 200 and done["usage"]["completion_tokens"] == 12
    assert done["choices"][0]["text"] in ("yes", "no")  # EOS tokens decode to nothing
    assert done["choices"][0]["finish_reason"] == "length"  # the EOS tokens past the end kept to the grammar


def check_calls(calls: list[dict], names: set[str]) -> None:
    assert calls
    params = {t["function"]["name"]: t["function"].get("parameters") for t in TOOLS}
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("call_")
        assert call["function"]["name"] in names
        arguments = json.loads(call["function"]["arguments"])
        if params[call["function"]["name"]]:
            jsonschema.validate(arguments, params[call["function"]["name"]])


@ON_THE_MODULE_LOOP
@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}], ids=["required", "named"]
)
async def test_forced_tool_calls_parse_and_validate_streamed_and_not(client, tool_choice):
    names = {"get_weather", "get_time"} if tool_choice == "required" else {"get_weather"}
    done = await client.chat.completions.create(
        model=MODEL, messages=CHAT["messages"], tools=TOOLS, tool_choice=tool_choice, max_tokens=200, seed=5
    )
    message = done.choices[0].message
    assert done.choices[0].finish_reason == "tool_calls"
    check_calls([c.model_dump() for c in message.tool_calls], names)
    streamed: dict[int, dict] = {}
    finish = None
    async for chunk in await client.chat.completions.create(
        model=MODEL,
        messages=CHAT["messages"],
        tools=TOOLS,
        tool_choice=tool_choice,
        max_tokens=200,
        seed=5,
        stream=True,
    ):
        delta = chunk.choices[0].delta
        finish = chunk.choices[0].finish_reason or finish
        for part in delta.tool_calls or []:
            call = streamed.setdefault(part.index, {"type": "function", "function": {"arguments": ""}})
            if part.id:
                call["id"], call["function"]["name"] = part.id, part.function.name
            call["function"]["arguments"] += part.function.arguments or ""
    assert finish == "tool_calls"
    check_calls(list(streamed.values()), names)
    assert [c["function"] for c in streamed.values()] == [
        {"name": c.function.name, "arguments": c.function.arguments} for c in message.tool_calls
    ]


@ON_THE_MODULE_LOOP
async def test_a_tool_round_trip_renders_through_the_chat_template(client, server):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
    messages = [
        {"role": "user", "content": "What time is it?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "It is 12:30."},
    ]
    status, rendered = await post(server, "/tokenize", {"messages": messages, "tools": TOOLS})
    assert status == 200
    status, text = await post(server, "/detokenize", {"tokens": rendered["tokens"]})
    assert '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>' in text["prompt"]
    assert "It is 12:30." in text["prompt"] and "get_weather" in text["prompt"]
    done = await client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=5
    )
    assert done.choices[0].message.tool_calls is None


HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "celsius": true}}\n</tool_call>'
LLAMA3_CALL = '{"name": "get_weather", "parameters": {"city": "Oslo", "celsius": true}}'
# A Llama-3-style template written for these tests: tools listed as JSON, calls written as
# {"name": ..., "parameters": ...}, the built-in tool tag named.
LLAMA3_TEMPLATE = r"""{{- bos_token -}}
{%- if tools -%}{{- "<|start_header_id|>system<|end_header_id|>\n\nCall a function by answering with JSON "
    ~ "{\"name\": ..., \"parameters\": {...}} (or <|python_tag|> for built-in tools):\n" -}}
{%- for tool in tools -%}{{- tool | tojson ~ "\n" -}}{%- endfor -%}{{- "<|eot_id|>" -}}{%- endif -%}
{%- for message in messages -%}
{{- "<|start_header_id|>" ~ message.role ~ "<|end_header_id|>\n\n" ~ (message.content or "") ~ "<|eot_id|>" -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- "<|start_header_id|>assistant<|end_header_id|>\n\n" -}}{%- endif -%}
"""


def model_folder(tmp_path, arch: str, template: str | None = None):
    from tests.hf_fixtures import LLAMA3_SCALING, make_hf_checkpoint

    scaling = LLAMA3_SCALING if arch == "llama" else None
    folder = make_hf_checkpoint(arch, tmp_path / arch, seed=1, rope_scaling=scaling, max_position_embeddings=1024)
    if template is not None:
        (folder / "chat_template.jinja").write_text(template)
    return folder


@ON_THE_MODULE_LOOP
@pytest.mark.parametrize(
    ("arch", "template", "call"),
    [("qwen3", None, HERMES_CALL), ("llama", LLAMA3_TEMPLATE, LLAMA3_CALL)],
    ids=["qwen-style", "llama3-style"],
)
async def test_auto_tool_calls_work_without_a_parser_flag(tmp_path, arch, template, call):
    """The parser comes from the model's chat template; the answer is held to a call in the
    model's format (guided_choice), since a random-weight model would not write one by itself."""
    folder = model_folder(tmp_path, arch, template)
    running = await start_server(EngineConfig(model=str(folder), served_model_name=MODEL, device="cpu", port=0))
    try:
        body = {**CHAT, "tools": TOOLS, "guided_choice": [call], "max_tokens": 100}
        status, done = await post(running, "/v1/chat/completions", body)
        assert status == 200, done
        (choice,) = done["choices"]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
        (tool_call,) = choice["message"]["tool_calls"]
        assert tool_call["function"]["name"] == "get_weather"
        assert json.loads(tool_call["function"]["arguments"]) == {"city": "Oslo", "celsius": True}
    finally:
        await running.close()


@ON_THE_MODULE_LOOP
async def test_auto_tool_choice_without_a_known_format_is_a_clear_400(tmp_path):
    plain = "{{ bos_token }}{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}{{ tools }}"
    folder = model_folder(tmp_path, "qwen3", plain.replace("{{ tools }}", ""))
    running = await start_server(EngineConfig(model=str(folder), served_model_name=MODEL, device="cpu", port=0))
    try:
        status, err = await post(running, "/v1/chat/completions", {**CHAT, "tools": TOOLS})
        assert status == 400 and "--tool-call-parser" in err["error"]["message"]
        status, _ = await post(running, "/v1/chat/completions", {**CHAT, "max_tokens": 3})
        assert status == 200  # and the server keeps serving
    finally:
        await running.close()


def streamed_message(chunks: list[dict]) -> tuple[str | None, list[dict], str | None]:
    """Content, tool calls and finish reason, put together from a chat stream's chunks."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        for choice in chunk["choices"]:
            finish = choice["finish_reason"] or finish
            content += choice["delta"].get("content") or ""
            for part in choice["delta"].get("tool_calls", []):
                call = calls.setdefault(part["index"], {"name": None, "arguments": ""})
                call["name"] = part["function"].get("name") or call["name"]
                call["arguments"] += part["function"]["arguments"]
    return content or None, list(calls.values()), finish


@ON_THE_MODULE_LOOP
async def test_a_tool_call_cut_by_max_tokens_is_the_same_streamed_and_not(server):
    """For each tool_choice, max_tokens ends the answer in the tag, in the name and in the
    arguments: finish_reason "length", the call (once named) with its partial arguments, no
    wrapper as text, either way."""
    for tool_choice in ("auto", "required", NAMED):
        await _cut_tool_calls(server, tool_choice)


async def _cut_tool_calls(server, tool_choice) -> None:
    body = {**CHAT, "tools": TOOLS, "tool_choice": tool_choice}
    if tool_choice == "auto":
        body["guided_choice"] = [HERMES_CALL]
    for max_tokens in (3, 24, 60):
        status, done = await post(server, "/v1/chat/completions", {**body, "max_tokens": max_tokens})
        assert status == 200, done
        (choice,) = done["choices"]
        calls = [c["function"] for c in choice["message"].get("tool_calls") or []]
        whole = (choice["message"]["content"], calls, choice["finish_reason"])
        chunks = await stream(server, "/v1/chat/completions", {**body, "max_tokens": max_tokens})
        assert streamed_message(chunks) == whole, max_tokens
        assert whole[0] is None, (max_tokens, whole)  # never the wrapper as text
        assert all(call["name"] in ("get_weather", "get_time") for call in calls)
        if max_tokens == 3:
            assert whole == (None, [], "length")
        elif whole[2] == "tool_calls":  # "required" may choose get_time, whose call is short
            assert tool_choice == "required" and all(json.loads(call["arguments"]) == {} for call in calls)
        else:
            assert whole[2] == "length" and (calls or max_tokens == 24), (max_tokens, whole)


def output(text: str, finished: bool) -> RequestOutput:
    return RequestOutput("r", text, [1], None, finished, "stop" if finished else None, 3, 1)


def test_auto_tool_calls_come_back_as_tool_calls_whole_and_streamed():
    """What the parser makes of a model that answers in its tool-call format."""
    text = 'Let me check.<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    fmt = ChatFormat("id", MODEL, None, [ChoiceSpec(0, 0)], 3, get_parser("hermes"))
    body = fmt.full({0: [output(text[:20], False), output(text[20:], True)]})
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Let me check."
    (call,) = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_time", "arguments": '{"zone": "UTC"}'}
    fmt = ChatFormat("id", MODEL, None, [ChoiceSpec(0, 0)], 3, get_parser("hermes"))
    pieces = [text[i : i + 7] for i in range(0, len(text), 7)]
    chunks = [fmt.chunk(0, output(p, i == len(pieces) - 1), False) for i, p in enumerate(pieces)]
    deltas = [c["choices"][0] for c in chunks if c is not None]
    content = "".join(d["delta"].get("content", "") for d in deltas)
    arguments = "".join(t["function"]["arguments"] for d in deltas for t in d["delta"].get("tool_calls", []))
    assert content == "Let me check." and arguments == '{"zone": "UTC"}'
    assert deltas[-1]["finish_reason"] == "tool_calls"


@ON_THE_MODULE_LOOP
async def test_an_agent_tool_loop_with_the_official_client(client):
    """Ask with tools, run the call the model makes, send the result back, get an answer."""
    messages: list = [{"role": "user", "content": "What is the weather in Oslo?"}]
    first = await client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice="required", max_tokens=120, seed=2
    )
    message = first.choices[0].message
    assert message.tool_calls
    messages.append(message.model_dump(exclude_none=True))
    for call in message.tool_calls:
        result = {"get_weather": "sunny, 14 C", "get_time": "12:30"}[call.function.name]
        messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    final = await client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="none")
    assert final.choices[0].finish_reason in ("stop", "length") and final.choices[0].message.tool_calls is None
    assert final.usage.prompt_tokens > first.usage.prompt_tokens  # the call and its result are in the prompt


@ON_THE_MODULE_LOOP
async def test_a_grammar_past_llguidances_limits_ends_the_answer_as_abort_not_stop(server):
    """A repetition count of a million passes compilation and stops the matcher after a token:
    the answer then cannot follow its grammar, and says so ("stop" promises text that parses)."""
    body = {"model": MODEL, "prompt": "x", "guided_regex": "a{1000000}", "max_tokens": 8}
    status, done = await post(server, "/v1/completions", body)
    assert status == 200 and done["choices"][0]["finish_reason"] == "abort"
    status, fine = await post(server, "/v1/completions", {**body, "guided_regex": "a{3}"})
    assert (status, fine["choices"][0]["text"], fine["choices"][0]["finish_reason"]) == (200, "aaa", "stop")
