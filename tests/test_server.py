"""The HTTP server end to end: the official openai client, every bad input, disconnects, metrics."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import openai
import pytest

from superinfer.engine import contract as c
from superinfer.engine.config import EngineConfig
from superinfer.engine.core.plan import StepPlan
from superinfer.engine.process import ProcessEngine
from superinfer.engine.serving.server import RunningServer, start_server
from superinfer.engine.worker.runner import SubmittedStep
from tests.conftest import SERVED_MODEL

MODEL = SERVED_MODEL


async def all_blocks_free(server: RunningServer, timeout: float = 10.0) -> bool:
    """Wait (bounded) until the engine holds no request and every KV block is free again (with the
    engine in a process of its own: as its /metrics tell)."""
    if isinstance(server.server.engine, ProcessEngine):
        return await idle_by_metrics(server, timeout)
    core = server.server.core
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not core.scheduler.requests and core.kv.num_free_blocks == core.kv.num_blocks:
            return True
        await asyncio.sleep(0.01)
    return False


async def idle_by_metrics(server: RunningServer, timeout: float) -> bool:
    from prometheus_client.parser import text_string_to_metric_families

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        async with aiohttp.ClientSession() as http, http.get(server.url + c.METRICS_PATH) as resp:
            samples = [s for f in text_string_to_metric_families(await resp.text()) for s in f.samples]
        blocks = next(s.labels["num_gpu_blocks"] for s in samples if s.name == c.metric("info") + "_info")
        gpu_free = {"tier": "gpu", "state": "free"}
        free = [s.value for s in samples if s.name == c.metric("kv_blocks") and gpu_free.items() <= s.labels.items()]
        names = {c.metric(f"requests_{k}") for k in ("running", "waiting", "rotary")}
        live = sum(s.value for s in samples if s.name in names)
        if live == 0 and free == [float(blocks)]:
            return True
        await asyncio.sleep(0.02)
    return False


async def test_completions_with_the_openai_client(client):
    done = await client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert done.choices[0].finish_reason == "length"
    assert done.usage.completion_tokens == 8 and done.usage.prompt_tokens > 0
    stream = await client.completions.create(
        model=MODEL,
        prompt="Once upon a time",
        max_tokens=8,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    pieces = [chunk.choices[0].text async for chunk in stream]
    assert "".join(pieces) == done.choices[0].text


async def test_chat_with_the_openai_client(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    done = await client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    assert done.choices[0].message.role == "assistant" and done.usage.completion_tokens == 6
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = [chunk async for chunk in stream]
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == done.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 6
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"


async def test_models_health_ready(client, server):
    models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    model = await client.models.retrieve(MODEL)
    assert model.id == MODEL and model.model_dump() == models.data[0].model_dump()
    with pytest.raises(openai.NotFoundError) as err:
        await client.models.retrieve("org/other-model")
    assert err.value.body["code"] == "model_not_found" and "org/other-model" in err.value.body["message"]
    async with aiohttp.ClientSession() as http:
        for path in (c.HEALTH_PATH, c.READY_PATH):
            async with http.get(server.url + path) as resp:
                assert resp.status == 200


async def test_logprobs_in_both_apis(client):
    done = await client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, temperature=0, logprobs=2)
    lp = done.choices[0].logprobs
    assert len(lp.tokens) == 3 and len(lp.top_logprobs[0]) <= 2 and all(v <= 0 for v in lp.token_logprobs)
    chat = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and len(content[0].top_logprobs) == 2


BAD_REQUESTS = [
    (c.COMPLETIONS_PATH, b"{not json", 400, None),
    (c.COMPLETIONS_PATH, b"[1, 2]", 400, None),
    (c.COMPLETIONS_PATH, {"model": MODEL, "prompt": 5}, 400, "prompt"),
    # A union names the member that got furthest into the value (not "should be a valid string"):
    (c.COMPLETIONS_PATH, {"model": MODEL, "prompt": "x", "stop": [1, 2]}, 400, "stop.0"),
    (c.COMPLETIONS_PATH, {"model": MODEL, "prompt": [[1, "a"]]}, 400, "prompt.0.1"),
    (c.COMPLETIONS_PATH, {"model": MODEL, "prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    (c.COMPLETIONS_PATH, {"model": "gpt-nope", "prompt": "x"}, 404, "model"),
    (c.COMPLETIONS_PATH, {"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    (c.COMPLETIONS_PATH, {"model": MODEL, "prompt": "x", "max_tokens": 10_000}, 400, "max_tokens"),
    (c.COMPLETIONS_PATH, {"model": MODEL, "prompt": list(range(3, 300)), "max_tokens": 1}, 400, "prompt"),
    (c.COMPLETIONS_PATH, f'{{"model": "{MODEL}", "prompt": {"[" * 20_000}{"]" * 20_000}}}'.encode(), 400, None),
    (c.COMPLETIONS_PATH, f'{{"model": "{MODEL}", "prompt": "'.encode() + b'\xff\xfe"}', 400, None),
    (c.COMPLETIONS_PATH, f'{{"model": "{MODEL}", "prompt": "\\ud800"}}'.encode(), 400, None),
    (c.COMPLETIONS_PATH, f'{{"model": "{MODEL}", "prompt": "x", "logit_bias": {{"5": NaN}}}}'.encode(), 400, None),
    (c.COMPLETIONS_PATH, {"model": MODEL, "prompt": "x", "seed": 2**64}, 400, "seed"),
    # Each of these had stopped the engine, or stalled every request, from inside a step:
    (c.COMPLETIONS_PATH, {"model": MODEL, "prompt": "x", "priority": 2**63}, 400, "priority"),
    (c.COMPLETIONS_PATH, {"model": MODEL, "prompt": "x", "slo": {"tbt_ms": 1e308}}, 400, "slo.tbt_ms"),
    (c.COMPLETIONS_PATH, {"model": MODEL, "prompt": "x", "repetition_penalty": 1e-300}, 400, "repetition_penalty"),
    (c.COMPLETIONS_PATH, {"model": MODEL, "prompt": "x", "stop": [f"~{i}~" for i in range(200)]}, 400, "stop"),
    (c.COMPLETIONS_PATH, {"model": MODEL, "prompt": "x", "stop_token_ids": list(range(200))}, 400, "stop_token_ids"),
    (
        c.COMPLETIONS_PATH,
        {"model": MODEL, "prompt": "x", "min_tokens": 1, "stop_token_ids": [10**9]},
        400,
        "stop_token_ids",
    ),
    (
        c.COMPLETIONS_PATH,
        {"model": MODEL, "prompt": "x", "min_tokens": 1, "stop_token_ids": [-1]},
        400,
        "stop_token_ids",
    ),
    (c.COMPLETIONS_PATH, {"model": MODEL, "prompt": "x", "seed": -(2**63) - 1}, 400, "seed"),
    (c.COMPLETIONS_PATH, {"model": MODEL, "prompt": "x", "n": 0}, 400, "n"),
    (c.COMPLETIONS_PATH, {"model": MODEL, "prompt": "x", "frequency_penalty": 3}, 400, "frequency_penalty"),
    (c.COMPLETIONS_PATH, {"model": MODEL, "prompt": "x", "temprature": 1}, 400, "temprature"),
    (c.COMPLETIONS_PATH, {"model": MODEL, "prompt": "x", "guided_json": {"type": "nonsense"}}, 400, "guided_json"),
    (c.COMPLETIONS_PATH, {"model": MODEL, "prompt": "x", "guided_regex": "(unclosed"}, 400, "guided_regex"),
    (c.COMPLETIONS_PATH, {"model": MODEL, "prompt": "x", "logit_bias": {"x": 1}}, 400, "logit_bias"),
    (c.COMPLETIONS_PATH, {"model": MODEL, "prompt": "x", "best_of": 2}, 400, "best_of"),
    (c.COMPLETIONS_PATH, {"model": MODEL, "prompt": "x", "max_tokens": 0, "echo": False}, 400, "max_tokens"),
    (c.COMPLETIONS_PATH, {"model": MODEL, "prompt": ["x", ""]}, 400, "prompt"),
    (c.COMPLETIONS_PATH, {"model": MODEL, "prompt": "", "max_tokens": 1}, 400, "prompt"),
    (c.COMPLETIONS_PATH, {"model": MODEL, "prompt": "x", "temperature": -1}, 400, "temperature"),
    (c.COMPLETIONS_PATH, {"model": MODEL, "prompt": [10**9], "max_tokens": 1}, 400, None),
    (c.COMPLETIONS_PATH, {"model": MODEL, "prompt": "x", "slo": {"ttft_ms": -5}}, 400, "slo.ttft_ms"),
    (c.CHAT_COMPLETIONS_PATH, {"model": MODEL, "messages": []}, 400, "messages"),
    (c.CHAT_COMPLETIONS_PATH, {"model": MODEL, "messages": [{"role": "user"}]}, 400, "messages.0"),
    (
        c.CHAT_COMPLETIONS_PATH,
        {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        400,
        "messages.0.content",
    ),
    (c.CHAT_COMPLETIONS_PATH, {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400, None),
    (
        c.CHAT_COMPLETIONS_PATH,
        {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
        400,
        "tools",
    ),
    (
        c.CHAT_COMPLETIONS_PATH,
        {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
        400,
        "top_logprobs",
    ),
]


async def test_bad_input_gets_openai_errors_and_the_server_keeps_serving(server, client):
    async with aiohttp.ClientSession() as http:
        for path, body, status, param in BAD_REQUESTS:
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            for stream in (False, True):
                if stream and isinstance(body, dict):
                    data = json.dumps({**body, "stream": True}).encode()
                async with http.post(
                    server.url + path, data=data, headers={"Content-Type": "application/json"}
                ) as resp:
                    payload = await resp.json()
                    assert resp.status == status, (body, payload)
                    assert set(payload["error"]) >= {"message", "type", "param", "code"}
                    assert payload["error"]["message"]
                    if param is not None:
                        assert payload["error"]["param"] == param, (body, payload)
        data = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 2}).encode()
        async with http.post(server.url + c.COMPLETIONS_PATH, data=data, headers={c.SLO_TBT_HEADER: "inf"}) as resp:
            assert resp.status == 400 and c.SLO_TBT_HEADER in (await resp.json())["error"]["message"]
        not_gzip = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
        data = json.dumps({"model": MODEL, "prompt": "x"}).encode()
        async with (
            aiohttp.ClientSession() as fresh,
            fresh.post(server.url + c.COMPLETIONS_PATH, data=data, headers=not_gzip) as resp,
        ):
            assert resp.status == 400 and "could not be read" in (await resp.json())["error"]["message"]
        big = json.dumps({"model": MODEL, "prompt": "x" * 100_000}).encode()
        async with http.post(server.url + c.COMPLETIONS_PATH, data=big) as resp:
            assert resp.status == 413 and "error" in await resp.json()
        async with http.get(server.url + "/v1/nothing") as resp:
            assert resp.status == 404 and "error" in await resp.json()
    done = await client.completions.create(model=MODEL, prompt="still alive", max_tokens=2)
    assert done.usage.completion_tokens >= 1
    assert await all_blocks_free(server)


async def test_openai_client_raises_typed_errors(client):
    with pytest.raises(openai.NotFoundError):
        await client.completions.create(model="other", prompt="x")
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        await client.completions.create(model=MODEL, prompt="x", max_tokens=100_000)


async def test_client_disconnect_mid_stream_frees_blocks(server):
    body = {"model": MODEL, "prompt": "a long story", "max_tokens": 200, "stream": True, "ignore_eos": True}
    async with aiohttp.ClientSession() as http:
        resp = await http.post(server.url + c.COMPLETIONS_PATH, json=body)
        assert resp.status == 200
        got = 0
        async for line in resp.content:
            got += line.startswith(b"data: ")
            if got == 3:
                break
        assert server.server.core.scheduler.requests, "the request is live mid-stream"
        resp.close()  # drop the connection
    assert await all_blocks_free(server)
    aborted = server.server.core.metrics.registry.get_sample_value(
        c.metric("requests_finished_total"), {"model_name": MODEL, "finished_reason": "abort"}
    )
    assert aborted == 1.0


async def test_api_key():
    running = await start_server(
        EngineConfig(
            model="tiny",
            device="cpu",
            port=0,
            api_key="s3cret",
            num_gpu_blocks=32,
            max_model_len=128,
        )
    )
    try:
        async with openai.AsyncOpenAI(base_url=running.url + "/v1", api_key="wrong", max_retries=0) as bad:
            with pytest.raises(openai.AuthenticationError):
                await bad.models.list()
        async with openai.AsyncOpenAI(base_url=running.url + "/v1", api_key="s3cret", max_retries=0) as good:
            assert (await good.models.list()).data[0].id == "tiny"
        async with aiohttp.ClientSession() as http, http.get(running.url + c.HEALTH_PATH) as resp:
            assert resp.status == 200  # probes need no key
    finally:
        await running.close()


async def test_metrics_and_per_request_slo(server, client):
    # TBT SLOs so loose that a busy machine cannot miss them: only the TTFT outcome differs.
    headers = {c.SLO_TTFT_HEADER: "1e-6", c.SLO_TBT_HEADER: "1e9"}
    await client.completions.create(model=MODEL, prompt="x", max_tokens=3, extra_headers=headers)
    slo = {"ttft_ms": 1e9, "tbt_ms": 1e9}
    await client.completions.create(model=MODEL, prompt="x", max_tokens=3, extra_body={"slo": slo})
    async with aiohttp.ClientSession() as http, http.get(server.url + c.METRICS_PATH) as resp:
        text = await resp.text()
    for name in (
        "requests_running",
        "kv_cache_usage_ratio",
        "time_to_first_token_seconds_bucket",
        "generation_tokens_total",
        "slo_requests_total",
        "slo_target_seconds",
    ):
        assert c.metric(name) in text
    reg = server.server.core.metrics.registry
    labels = {"model_name": MODEL, "tbt": "met", "slo_class": c.DEFAULT_SLO_CLASS}
    assert reg.get_sample_value(c.metric("slo_requests_total"), {**labels, "ttft": "missed"}) == 1.0
    assert reg.get_sample_value(c.metric("slo_requests_total"), {**labels, "ttft": "met"}) == 1.0
    target = {"model_name": MODEL, "kind": "ttft", "slo_class": c.DEFAULT_SLO_CLASS}
    assert reg.get_sample_value(c.metric("slo_target_seconds"), target) == 5.0


async def test_concurrent_streams_all_complete(server):
    async def one(http: aiohttp.ClientSession, i: int) -> int:
        body = {"model": MODEL, "prompt": f"request {i}", "max_tokens": 10, "stream": True, "ignore_eos": True}
        body["stream_options"] = {"include_usage": True}
        async with http.post(server.url + c.COMPLETIONS_PATH, json=body) as resp:
            chunks = [json.loads(line[6:]) async for line in resp.content if line.startswith(b"data: {")]
        return chunks[-1]["usage"]["completion_tokens"]

    async with aiohttp.ClientSession() as http:
        counts = await asyncio.gather(*(one(http, i) for i in range(12)))
    assert counts == [10] * 12
    assert await all_blocks_free(server)


async def test_drain_refuses_new_work(server, client):
    await server.drain(timeout_s=1.0)
    async with aiohttp.ClientSession() as http, http.get(server.url + c.READY_PATH) as resp:
        assert resp.status == 503
    with pytest.raises(openai.APIStatusError) as err:
        await client.completions.create(model=MODEL, prompt="x", max_tokens=2)
    assert err.value.status_code == 503


async def until(condition, timeout: float = 10.0) -> None:
    """Wait (bounded) for a condition on the engine's state."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


async def test_queue_bound_answers_503_with_retry_after():
    running = await start_server(
        EngineConfig(
            engine_process=False,  # the tests read the engine core's state
            model="tiny",
            device="cpu",
            port=0,
            num_gpu_blocks=16,
            max_num_seqs=1,
            max_waiting_requests=1,
            max_model_len=256,
        )
    )
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 200, "ignore_eos": True}
    scheduler = running.server.core.scheduler
    try:
        async with aiohttp.ClientSession() as http:
            first = asyncio.create_task(http.post(running.url + c.COMPLETIONS_PATH, json=body))
            await until(lambda: scheduler.num_running == 1)
            second = asyncio.create_task(http.post(running.url + c.COMPLETIONS_PATH, json=body))
            await until(lambda: scheduler.num_waiting == 1)  # queued behind the first (max_num_seqs=1)
            async with http.post(running.url + c.COMPLETIONS_PATH, json=body) as third:
                assert third.status == 503 and third.headers["Retry-After"] == "1"
                assert (await third.json())["error"]["code"] == "overloaded"
            for task in (first, second):
                task.cancel()
        assert await all_blocks_free(running)
    finally:
        await running.close()


async def test_engine_failure_mid_stream_ends_the_stream_with_an_error(server):
    """A broken step kills the engine: live streams get an error event and [DONE], not a hang."""
    runner = server.server.core.runner
    real_submit, calls = runner.submit, []

    def failing_submit(plan: StepPlan) -> SubmittedStep:
        calls.append(plan.step_id)
        if len(calls) == 4:
            raise RuntimeError("simulated device failure")
        return real_submit(plan)

    runner.submit = failing_submit
    body = {"model": MODEL, "prompt": "x", "max_tokens": 50, "stream": True, "ignore_eos": True}
    async with aiohttp.ClientSession() as http:
        async with http.post(server.url + c.COMPLETIONS_PATH, json=body) as resp:
            raw = await asyncio.wait_for(resp.content.read(), 30)  # bounded: a hang fails the test
        lines = [line for line in raw.decode().splitlines() if line]
        events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        assert "error" in events[-1] and "simulated device failure" in events[-1]["error"]["message"]
        assert lines[-1] == "data: [DONE]"
        async with http.get(server.url + c.HEALTH_PATH) as health:
            assert health.status == 503


async def test_exported_metrics_are_exactly_the_contract():
    """What /metrics really exports stays inside the contract the dashboards are checked against."""
    from prometheus_client.parser import text_string_to_metric_families

    running = await start_server(
        EngineConfig(
            engine_process=False,  # the tests read the engine core's state
            model="tiny",
            device="cpu",
            port=0,
            num_gpu_blocks=64,
            policy="rotary",
            num_cpu_blocks=64,
            metrics_compat="vllm",
            max_model_len=256,
        )
    )
    try:
        async with openai.AsyncOpenAI(base_url=running.url + "/v1", api_key="x", max_retries=0) as client:
            await client.completions.create(model="tiny", prompt="hello", max_tokens=4)
        async with aiohttp.ClientSession() as http, http.get(running.url + c.METRICS_PATH) as resp:
            text = await resp.text()
    finally:
        await running.close()
    samples = [s for fam in text_string_to_metric_families(text) for s in fam.samples]
    exported = {s.name for s in samples if s.name.startswith((c.METRIC_PREFIX, "vllm:"))}
    assert exported <= c.exported_series_names(), exported - c.exported_series_names()
    families = {c.metric(n) for n in (*c.GAUGES, *c.HISTOGRAMS)} | {c.metric(n) + "_total" for n in c.COUNTERS}
    missing = {f for f in families if not any(n == f or n.startswith(f + "_") for n in exported)}
    # Labelled counters and histograms appear once first used (no rotation happened here).
    unused = {c.metric(n) + "_total" for n in ("preemptions", "kv_swap_bytes", "rotations")}
    copies = ("kv_swap_seconds", "rotation_seconds", "kv_copy_queue_seconds", "kv_copy_bandwidth_bytes_per_second")
    assert missing <= unused | {c.metric(n) for n in (*copies, "kv_copy_hidden_ratio")}, missing
    for name in c.VLLM_COMPAT_METRICS:
        assert any(n == name or n.startswith(name + "_") for n in exported), name
    # Each engine series carries exactly its family's contract labels (the dashboards group by them).
    families = {**c.GAUGES, **c.COUNTERS, **c.HISTOGRAMS, c.SLO_TARGET_GAUGE: c.SLO_TARGET_LABELS}
    for sample in samples:
        if not sample.name.startswith(c.METRIC_PREFIX) or sample.name.startswith(c.metric("info")):
            continue
        base = sample.name.removeprefix(c.METRIC_PREFIX)
        family = next(f for f in sorted(families, key=len, reverse=True) if base.startswith(f))
        extra = {"le"} if sample.name.endswith("_bucket") else set()
        assert set(sample.labels) == {"model_name", *families[family], *extra}, sample
