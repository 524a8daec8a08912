"""The OpenAI API fields clients, harnesses and benchmark tools send: n, batched prompts, echo and
prompt logprobs, penalties and logit_bias, streaming usage, nulls, unknown fields, and vLLM's
tokenizer endpoints. Over real HTTP, with the official client where it can express the call."""

from __future__ import annotations

import json
import logging

import aiohttp
import pytest

from superinfer.engine import contract as c
from superinfer.engine.core.request import SamplingParams
from superinfer.engine.engine import AsyncEngine
from tests.test_server import MODEL, all_blocks_free


async def post(server, path: str, body: dict) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as http, http.post(server.url + path, json=body) as resp:
        return resp.status, await resp.json()


async def stream(server, path: str, body: dict) -> list[dict]:
    async with aiohttp.ClientSession() as http, http.post(server.url + path, json={**body, "stream": True}) as resp:
        assert resp.status == 200
        lines = [line async for line in resp.content if line.startswith(b"data: ")]
    assert lines[-1] == b"data: [DONE]\n"
    return [json.loads(line[6:]) for line in lines[:-1]]


async def test_n_choices_differ_and_repeat_with_a_seed(client, server):
    async def ask():
        return await client.completions.create(
            model=MODEL,
            prompt="The weather",
            max_tokens=8,
            n=3,
            seed=11,
            temperature=1.0,
            extra_body={"ignore_eos": True},
        )

    first, again = await ask(), await ask()
    texts = [ch.text for ch in first.choices]
    assert [ch.index for ch in first.choices] == [0, 1, 2]
    assert len(set(texts)) > 1
    assert texts == [ch.text for ch in again.choices]
    assert first.usage.completion_tokens == 24
    assert first.usage.prompt_tokens == len((await tokenize(server, "The weather"))["tokens"])
    assert await all_blocks_free(server)


async def test_seeds_at_the_ends_of_64_bits_serve_every_choice(server):
    """Choice i draws with seed + i, wrapped into 64 bits: the largest seed with n = 2 serves both
    choices (the second with the smallest seed), where an overflow had stopped the engine."""
    body = {"model": MODEL, "prompt": "x", "max_tokens": 3, "n": 2, "ignore_eos": True}
    status, top = await post(server, c.COMPLETIONS_PATH, {**body, "seed": 2**63 - 1})
    assert status == 200 and len(top["choices"]) == 2
    status, bottom = await post(server, c.COMPLETIONS_PATH, {**body, "n": 1, "seed": -(2**63)})
    assert status == 200 and bottom["choices"][0]["text"] == top["choices"][1]["text"]
    assert await all_blocks_free(server)


async def test_later_choices_share_the_first_ones_prompt_blocks(server):
    engine: AsyncEngine = server.server.engine
    prompt = list(range(3, 3 + 70))  # 4 full blocks of 16, and a partial one
    sampling = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    first = engine.generate("first", prompt, sampling)
    second = engine.generate("second", prompt, sampling, after="first")
    outs_first = [o async for o in first]
    outs_second = [o async for o in second]
    assert outs_first[0].num_cached_tokens == 0
    assert outs_second[0].num_cached_tokens == 64
    assert [o.token_ids for o in outs_first] == [o.token_ids for o in outs_second]


async def test_batched_prompts_give_one_choice_per_prompt_times_n(server):
    body = {"model": MODEL, "prompt": ["one", "two two"], "n": 2, "max_tokens": 4, "temperature": 0}
    status, done = await post(server, c.COMPLETIONS_PATH, {**body, "ignore_eos": True})
    assert status == 200
    texts = {ch["index"]: ch["text"] for ch in done["choices"]}
    assert sorted(texts) == [0, 1, 2, 3]
    assert texts[0] == texts[1] and texts[2] == texts[3]  # greedy: a prompt's choices agree
    assert done["usage"]["completion_tokens"] == 16
    chunks = await stream(server, c.COMPLETIONS_PATH, {**body, "ignore_eos": True})
    streamed: dict[int, str] = {}
    for chunk in chunks:
        for ch in chunk["choices"]:
            streamed[ch["index"]] = streamed.get(ch["index"], "") + ch["text"]
    assert streamed == texts
    finals = [ch["index"] for chunk in chunks for ch in chunk["choices"] if ch["finish_reason"]]
    assert sorted(finals) == [0, 1, 2, 3]
    tokens = [[5, 6, 7], [8, 9]]
    status, done = await post(server, c.COMPLETIONS_PATH, {**body, "prompt": tokens, "n": 1})
    assert status == 200 and done["usage"]["prompt_tokens"] == 5 and len(done["choices"]) == 2


async def tokenize(server, text: str) -> dict:
    status, body = await post(server, "/tokenize", {"model": MODEL, "prompt": text})
    assert status == 200
    return body


@pytest.mark.parametrize("max_tokens", [0, 1])
async def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_asks(server, max_tokens):
    prompt = "Paris is the capital of"
    ids = (await tokenize(server, prompt))["tokens"]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "echo": True, "logprobs": 1, "temperature": 0}
    status, done = await post(server, c.COMPLETIONS_PATH, body)
    assert status == 200, done
    choice = done["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"].startswith(prompt)
    assert len(lp["tokens"]) == len(ids) + max_tokens
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(v <= 0 for v in lp["token_logprobs"][1:])
    assert done["usage"]["completion_tokens"] == max_tokens
    if max_tokens == 0:
        assert choice["text"] == prompt
    assert "prompt_logprobs" not in choice  # only when asked for by name, as vLLM does
    # vLLM's prompt_logprobs field scores the same tokens the same way.
    status, scored = await post(
        server, c.COMPLETIONS_PATH, {**body, "echo": False, "max_tokens": 1, "prompt_logprobs": 0}
    )
    prompt_lps = scored["choices"][0]["prompt_logprobs"]
    assert prompt_lps[0] is None
    for position in range(1, len(ids)):
        entry = prompt_lps[position][str(ids[position])]
        assert entry["logprob"] == pytest.approx(lp["token_logprobs"][position], abs=1e-5)
        assert isinstance(entry["rank"], int) and entry["rank"] >= 1


async def test_logit_bias_and_penalties_over_http(client):
    forced = await client.completions.create(
        model=MODEL, prompt="x", max_tokens=5, logit_bias={"77": 100}, extra_body={"ignore_eos": True}
    )
    assert forced.usage.completion_tokens == 5
    detok = await client.post("/../detokenize", cast_to=object, body={"tokens": [77] * 5})
    assert forced.choices[0].text == detok["prompt"]
    penalized = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=6,
        temperature=0,
        presence_penalty=1.0,
        frequency_penalty=1.0,
        extra_body={"repetition_penalty": 1.2, "min_p": 0.1, "top_k": 5},
    )
    assert penalized.choices[0].finish_reason in ("stop", "length")


async def test_streaming_usage_null_and_continuous_usage(server):
    body = {"model": MODEL, "prompt": "count", "max_tokens": 6, "ignore_eos": True}
    chunks = await stream(server, c.COMPLETIONS_PATH, {**body, "stream_options": {"include_usage": True}})
    assert all(chunk["usage"] is None for chunk in chunks[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
    assert all(ch["text"] or ch["finish_reason"] for chunk in chunks[:-1] for ch in chunk["choices"])
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = await stream(
        server,
        c.CHAT_COMPLETIONS_PATH,
        {**body, "messages": [{"role": "user", "content": "hi"}], "prompt": None, "stream_options": options},
    )
    running = [chunk["usage"]["completion_tokens"] for chunk in chunks]
    assert running == sorted(running) and running[-1] == 6
    assert all(chunk["usage"]["prompt_tokens"] > 0 for chunk in chunks)


async def test_null_means_default_and_unknown_fields_are_ignored_with_a_warning(server, caplog):
    body = {
        "model": MODEL,
        "prompt": "x",
        "max_tokens": 2,
        "temperature": None,
        "top_p": None,
        "presence_penalty": None,
        "n": None,
        "stop": None,
        "some_new_field": {"a": 1},
    }
    with caplog.at_level(logging.WARNING, logger="superinfer.server"):
        status, done = await post(server, c.COMPLETIONS_PATH, body)
    assert status == 200 and done["usage"]["completion_tokens"] >= 1
    assert "some_new_field" in caplog.text


async def test_every_bad_field_is_named_and_logged_with_the_request_id(server, caplog):
    body = {"model": MODEL, "prompt": "x", "temperature": 9, "top_p": 0, "max_tokens": "many"}
    with caplog.at_level(logging.WARNING, logger="superinfer.server"):
        async with aiohttp.ClientSession() as http:
            headers = {"X-Request-Id": "req-1234"}
            async with http.post(server.url + c.COMPLETIONS_PATH, json=body, headers=headers) as resp:
                payload = await resp.json()
                assert resp.status == 400 and resp.headers["x-request-id"] == "req-1234"
    message = payload["error"]["message"]
    assert all(f"'{name}'" in message for name in ("temperature", "top_p", "max_tokens"))
    assert "req-1234" in caplog.text and "temperature" in caplog.text


async def test_include_stop_str_in_output(client):
    plain = await client.completions.create(
        model=MODEL, prompt="abc", max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    text = plain.choices[0].text
    stop = text[3:5]
    assert len(stop) == 2
    for include, expected in ((False, text[: text.index(stop)]), (True, text[: text.index(stop) + 2])):
        done = await client.completions.create(
            model=MODEL,
            prompt="abc",
            max_tokens=12,
            temperature=0,
            stop=[stop],
            extra_body={"ignore_eos": True, "include_stop_str_in_output": include},
        )
        assert done.choices[0].text == expected and done.choices[0].finish_reason == "stop"


async def test_tokenizer_endpoints(server):
    tokens = (await tokenize(server, "hello world"))["tokens"]
    status, back = await post(server, "/detokenize", {"model": MODEL, "tokens": tokens})
    assert status == 200 and "hello world" in back["prompt"]
    messages = [{"role": "user", "content": "hi"}]
    status, chat = await post(server, "/tokenize", {"messages": messages, "return_token_strs": True})
    assert status == 200 and chat["count"] == len(chat["tokens"]) == len(chat["token_strs"]) > 3
    assert chat["max_model_len"] == 256
    async with aiohttp.ClientSession() as http, http.get(server.url + "/tokenizer_info") as resp:
        info = await resp.json()
    assert resp.status == 200 and info["chat_template"] and info["eos_token"]
    status, err = await post(server, "/detokenize", {"tokens": [10**9]})
    assert status == 400 and err["error"]["param"] == "tokens"
    status, err = await post(server, "/tokenize", {"prompt": "x", "messages": messages})
    assert status == 400
