"""POST /v1/responses with the official openai client and raw HTTP: whole and streamed answers
agree, every streamed event validates against the SDK's own models, function tools and
text.format work, and what a stateless server cannot do is a clear 400."""

from __future__ import annotations

import json
from typing import Literal

import aiohttp
import jsonschema
import openai
import pydantic
import pytest
import pytest_asyncio
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from superinfer.engine.config import EngineConfig
from superinfer.engine.output import RequestOutput
from superinfer.engine.serving.completion_bodies import ChatFormat, ChoiceSpec
from superinfer.engine.serving.responses_output import ResponsesFormat
from superinfer.engine.serving.responses_request import ResponsesRequest, chat_messages
from superinfer.engine.serving.server import start_server
from superinfer.engine.serving.tool_parsers import get_parser
from tests.test_openai_api import post
from tests.test_server import MODEL
from tests.test_structured_api import HERMES_CALL, SCHEMA, output

EVENTS = TypeAdapter(ResponseStreamEvent)
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}, "celsius": {"type": "boolean"}},
        "required": ["city", "celsius"],
        "additionalProperties": False,
    },
}
TIME = {"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {}}}


# One server for the module (its tests only read it), on the module's event loop.
ON_THE_MODULE_LOOP = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server():
    """The tiny model with room for tool listings."""
    running = await start_server(
        EngineConfig(model="tiny", served_model_name=MODEL, device="cpu", port=0, max_model_len=1024)
    )
    yield running
    await running.close()


@pytest_asyncio.fixture(loop_scope="module")
async def client(server):
    async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as cl:
        yield cl


async def stream_events(server, body: dict) -> list:
    """The stream's events, each validated by the SDK's own event models."""
    async with (
        aiohttp.ClientSession() as http,
        http.post(server.url + "/v1/responses", json={**body, "stream": True}) as resp,
    ):
        assert resp.status == 200 and resp.content_type == "text/event-stream"
        raw = (await resp.read()).decode()
    events = []
    for block in raw.strip().split("\n\n"):
        kind, data = block.split("\n")
        assert kind.startswith("event: ") and data.startswith("data: ")
        event = EVENTS.validate_python(json.loads(data[6:]))
        assert event.type == kind[7:]
        events.append(event)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1].type in ("response.completed", "response.incomplete", "response.failed")
    return events


def streamed_output(events: list) -> list[dict]:
    """The output items as the delta events build them, checked against the done events."""
    items: dict[int, dict] = {}
    for e in events:
        if e.type == "response.output_item.added":
            items[e.output_index] = e.item.model_dump(exclude_none=True)
        elif e.type == "response.output_text.delta":
            items[e.output_index]["content"][0]["text"] += e.delta
        elif e.type == "response.content_part.added":
            items[e.output_index]["content"] = [e.part.model_dump(exclude_none=True)]
        elif e.type == "response.function_call_arguments.delta":
            items[e.output_index]["arguments"] += e.delta
        elif e.type == "response.output_item.done":
            done = e.item.model_dump(exclude_none=True)
            assert {**items[e.output_index], "status": done["status"]} == done
            items[e.output_index] = done
    final = events[-1].response.model_dump(exclude_none=True)["output"]
    assert [items[i] for i in sorted(items)] == final
    return final


def without_ids(items: list[dict]) -> list[dict]:
    return [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in items]


async def answer_both_ways(server, body: dict) -> tuple[Response, list]:
    """The whole response (validated) and the streamed events, which must build the same output."""
    status, whole = await post(server, "/v1/responses", body)
    assert status == 200, whole
    response = Response.model_validate(whole)
    events = await stream_events(server, body)
    assert without_ids(streamed_output(events)) == without_ids(whole["output"])
    final = events[-1].response
    counts = ("input_tokens", "output_tokens", "total_tokens")  # cached_tokens: the second reads the first's cache
    assert [final.status, *(getattr(final.usage, k) for k in counts)] == [
        response.status,
        *(getattr(response.usage, k) for k in counts),
    ]
    return response, events


@ON_THE_MODULE_LOOP
async def test_text_answers_whole_and_streamed_with_the_official_client(client, server):
    done = await client.responses.create(
        model=MODEL, instructions="Be brief.", input="Tell me about the harbor.", max_output_tokens=12, temperature=0
    )
    assert done.object == "response" and done.id.startswith("resp_") and done.model == MODEL
    assert done.status == "incomplete" and done.incomplete_details.reason == "max_output_tokens"
    assert done.usage.output_tokens == 12 and done.usage.total_tokens == done.usage.input_tokens + 12
    assert done.output_text and done.output[0].content[0].type == "output_text"
    kinds = []
    text = ""
    async with await client.responses.create(
        model=MODEL,
        instructions="Be brief.",
        input="Tell me about the harbor.",
        max_output_tokens=12,
        temperature=0,
        stream=True,
    ) as events:
        async for event in events:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                text += event.delta
    assert text == done.output_text
    assert kinds[-1] == "response.incomplete" and "response.output_text.done" in kinds
    response, _ = await answer_both_ways(
        server, {"model": MODEL, "input": [{"role": "user", "content": "Hi"}], "max_output_tokens": 6, "seed": 4}
    )
    assert response.metadata == {} and response.store is False


@ON_THE_MODULE_LOOP
@pytest.mark.parametrize(
    "tool_choice", ["auto", "required", {"type": "function", "name": "get_weather"}], ids=["auto", "required", "named"]
)
async def test_function_tools_whole_and_streamed(server, tool_choice):
    body = {
        "model": MODEL,
        "input": "Weather in Oslo?",
        "tools": [WEATHER, TIME],
        "tool_choice": tool_choice,
        "max_output_tokens": 200,
        "seed": 5,
    }
    if tool_choice == "auto":  # the random model would not call by itself: hold it to a call
        body["guided_choice"] = [HERMES_CALL]
    response, events = await answer_both_ways(server, body)
    assert response.status == "completed"
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls and all(call.call_id.startswith("call_") and call.status == "completed" for call in calls)
    for call in calls:
        assert call.name == "get_weather" or (tool_choice == "required" and call.name == "get_time")
        if call.name == "get_weather":
            jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    assert "response.function_call_arguments.done" in [e.type for e in events]


@ON_THE_MODULE_LOOP
async def test_a_function_call_output_round_trip(client, server):
    first = await client.responses.create(
        model=MODEL,
        input="Weather in Oslo?",
        tools=[WEATHER],
        tool_choice="required",
        max_output_tokens=200,
        extra_body={"seed": 2},
    )
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls
    items = [
        {"role": "user", "content": "Weather in Oslo?"},
        *(call.model_dump(exclude_none=True) for call in calls),
        *({"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 14 C"} for call in calls),
    ]
    second = await client.responses.create(
        model=MODEL, input=items, tools=[WEATHER], tool_choice="none", max_output_tokens=4
    )
    assert second.status in ("completed", "incomplete") and second.output[0].type == "message"
    assert second.usage.input_tokens > first.usage.input_tokens  # the call and its output are in the prompt


@ON_THE_MODULE_LOOP
async def test_the_sdk_stream_helper_accumulates_a_final_response(client):
    """`client.responses.stream(...)`, the SDK's helper that builds the response from the events:
    a finished answer (structured output parsed into the model, a forced call) is its final
    response; one cut by max_output_tokens ends in `response.incomplete`, as OpenAI's does, and
    the helper has no final response for it (it raises, as it does against OpenAI)."""

    class Answer(pydantic.BaseModel):  # bounded, so the random model closes the JSON
        color: Literal["red", "green", "blue"]
        ok: bool

    async with client.responses.stream(
        model=MODEL, input="A color as JSON", text_format=Answer, max_output_tokens=200, temperature=0
    ) as stream:
        kinds = [event.type async for event in stream]
        final = await stream.get_final_response()
    assert kinds[-1] == "response.completed" and final.status == "completed"
    assert isinstance(final.output_parsed, Answer) and final.usage.output_tokens > 0
    async with client.responses.stream(
        model=MODEL,
        input="Weather in Oslo?",
        tools=[{**WEATHER, "strict": True}],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=200,
        temperature=0,
    ) as stream:
        final = await stream.get_final_response()
    (call,) = final.output
    assert call.type == "function_call" and call.status == "completed" and call.name == "get_weather"
    jsonschema.validate(call.parsed_arguments, WEATHER["parameters"])
    async with client.responses.stream(
        model=MODEL, input="Hi", max_output_tokens=4, extra_body={"ignore_eos": True}
    ) as stream:
        kinds = [event.type async for event in stream]
        with pytest.raises(RuntimeError, match=r"response\.completed"):
            await stream.get_final_response()
    assert kinds[-1] == "response.incomplete"


def test_input_items_become_chat_messages():
    call = {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}", "id": "fc_1"}
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
        call,
        {**call, "call_id": "call_2"},
        {"type": "function_call_output", "call_id": "call_1", "output": "one"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "two"}]},
    ]
    tool_call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    assert chat_messages("Be brief.", items) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [tool_call, {**tool_call, "id": "call_2"}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "one"},
        {"role": "tool", "tool_call_id": "call_2", "content": "two"},
    ]


@ON_THE_MODULE_LOOP
async def test_text_format_json_schema_validates_whole_and_streamed(server):
    text = {"format": {"type": "json_schema", "name": "weather", "schema": SCHEMA, "strict": True}}
    body = {"model": MODEL, "input": "Weather?", "text": text, "max_output_tokens": 200, "seed": 3}
    response, _ = await answer_both_ways(server, body)
    assert response.status == "completed" and response.text.format.type == "json_schema"
    jsonschema.validate(json.loads(response.output_text), SCHEMA)


REFUSED = [
    ({"store": True}, "store"),
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"background": True}, "background"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"tools": [{"type": "web_search"}]}, "tools[0]"),
    ({"tool_choice": {"type": "file_search"}, "tools": [WEATHER]}, "tool_choice"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"max_output_tokens": 5000}, "max_output_tokens"),
    ({"n": 2}, "n"),
    ({"max_output_tokensz": 3}, "max_output_tokensz"),
]


@ON_THE_MODULE_LOOP
async def test_what_the_server_cannot_do_is_a_clear_400_and_it_keeps_serving(server):
    for extra, param in REFUSED:
        body = {"model": MODEL, "input": "Hi", "max_output_tokens": 3, **extra}
        status, err = await post(server, "/v1/responses", body)
        assert status == 400 and err["error"]["param"] == param, err
    status, fine = await post(server, "/v1/responses", {"model": MODEL, "input": "Hi", "max_output_tokens": 3})
    assert status == 200 and fine["usage"]["output_tokens"] == 3


@ON_THE_MODULE_LOOP
async def test_unknown_model_and_slo_class_as_on_the_other_endpoints(client):
    with pytest.raises(openai.NotFoundError):
        await client.responses.create(model="other", input="Hi")
    with pytest.raises(openai.BadRequestError, match="unknown SLO class"):
        await client.responses.create(model=MODEL, input="Hi", extra_body={"slo_class": "gold"})
    done = await client.responses.create(
        model=MODEL, input="Hi", max_output_tokens=2, extra_body={"slo": {"ttft_ms": 500, "tbt_ms": 100}}
    )
    assert done.usage.output_tokens == 2


def response_format(body: dict) -> ResponsesFormat:
    request = ResponsesRequest.model_validate({"model": MODEL, "input": "Hi", **body})
    chat = ChatFormat("resp_1", MODEL, None, [ChoiceSpec(0, 0)], 3, get_parser("hermes"))
    return ResponsesFormat(chat, request, "resp_1")


def test_text_then_a_call_streams_as_two_items_and_an_abort_fails():
    """The item order a model that talks before it calls gives, read off the parser's deltas."""
    text = 'Let me check.<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    pieces = [text[i : i + 7] for i in range(0, len(text), 7)]
    fmt = response_format({"tools": [TIME]})
    events = fmt.start()
    for i, piece in enumerate(pieces):
        events += fmt.events(0, output(piece, i == len(pieces) - 1))
    events += fmt.finish()
    events = [EVENTS.validate_python(e) for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    message, call = streamed_output(events)
    assert message["content"][0]["text"] == "Let me check." and message["status"] == "completed"
    assert (call["name"], call["arguments"], call["status"]) == ("get_time", '{"zone": "UTC"}', "completed")
    assert events[-1].type == "response.completed"
    fmt = response_format({})
    aborted = RequestOutput("r", "x", [1], None, True, "abort", 3, 1)
    body = Response.model_validate(fmt.full({0: [aborted]}))
    assert body.status == "failed" and body.error.code == "server_error"


def test_an_empty_answer_is_an_empty_message_whole_and_streamed():
    """A stop string on the first token leaves no text: still one message item (clients read
    output[0]), the same streamed."""
    fmt = response_format({})
    body = Response.model_validate(fmt.full({0: [output("", True)]}))
    assert [(item.type, item.content[0].text) for item in body.output] == [("message", "")]
    fmt = response_format({})
    events = [EVENTS.validate_python(e) for e in [*fmt.start(), *fmt.events(0, output("", True)), *fmt.finish()]]
    (item,) = streamed_output(events)
    assert item["type"] == "message" and item["content"][0]["text"] == "" and item["status"] == "completed"
