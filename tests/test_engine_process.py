"""--engine-process: the engine core in a child process behind the same HTTP server.

The HTTP-only tests of test_server, test_openai_api and test_structured_api run again against it;
the same requests give the same bodies as with the engine on a thread; and the process-specific
paths: detokenization and stop strings on the server's side, metrics from the child, a child that
dies (503, then `superinfer serve` exits 1), a child that cannot start, drain and stop, and -tp 2.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import aiohttp
import openai
import pytest
import pytest_asyncio

from superinfer.engine import contract as c
from superinfer.engine.config import EngineConfig
from superinfer.engine.process import ProcessEngine
from superinfer.engine.serving.server import RunningServer, start_server
from tests import test_openai_api as api
from tests import test_server as srv
from tests import test_structured_api as structured
from tests.conftest import SERVED_MODEL
from tests.test_cli import free_port, wait_ready
from tests.test_tensor_parallel import _post, spawned_child

ON_THE_MODULE_LOOP = pytest.mark.asyncio(loop_scope="module")  # the module-scoped servers' loop

TIMEOUT_S = 120


def config(**overrides) -> EngineConfig:
    """conftest's `server` settings."""
    base = {
        "model": "tiny",
        "served_model_name": SERVED_MODEL,
        "device": "cpu",
        "port": 0,
        "max_model_len": 256,
        "num_gpu_blocks": 64,
        "max_request_bytes": 64 * 1024,
    }
    return EngineConfig(**{**base, **overrides})


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=[False, True], ids=["sync", "async-scheduling"])
async def proc(request):
    running = await start_server(config(engine_process=True, async_scheduling=request.param))
    assert isinstance(running.server.engine, ProcessEngine)
    yield running
    await running.close()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def threaded():
    running = await start_server(config(async_scheduling=True))
    yield running
    await running.close()


async def call(test, server: RunningServer, caplog: pytest.LogCaptureFixture) -> None:
    async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as client:
        available = {"server": server, "client": client, "caplog": caplog}
        await test(**{name: available[name] for name in inspect.signature(test).parameters})


HTTP_ONLY = [
    srv.test_completions_with_the_openai_client,
    srv.test_chat_with_the_openai_client,
    srv.test_models_health_ready,
    srv.test_logprobs_in_both_apis,
    srv.test_bad_input_gets_openai_errors_and_the_server_keeps_serving,
    srv.test_openai_client_raises_typed_errors,
    srv.test_concurrent_streams_all_complete,
    api.test_n_choices_differ_and_repeat_with_a_seed,
    api.test_later_choices_share_the_first_ones_prompt_blocks,
    api.test_batched_prompts_give_one_choice_per_prompt_times_n,
    api.test_logit_bias_and_penalties_over_http,
    api.test_streaming_usage_null_and_continuous_usage,
    api.test_null_means_default_and_unknown_fields_are_ignored_with_a_warning,
    api.test_every_bad_field_is_named_and_logged_with_the_request_id,
    api.test_include_stop_str_in_output,
    api.test_tokenizer_endpoints,
]


@ON_THE_MODULE_LOOP
@pytest.mark.parametrize("test", HTTP_ONLY, ids=[t.__name__.removeprefix("test_") for t in HTTP_ONLY])
async def test_the_http_tests_pass_with_the_engine_in_a_process(test, proc, caplog):
    await call(test, proc, caplog)


@ON_THE_MODULE_LOOP
@pytest.mark.parametrize("max_tokens", [0, 1])
async def test_echo_and_prompt_logprobs(proc, max_tokens):
    await api.test_echo_with_logprobs_scores_the_prompt_as_lm_eval_asks(proc, max_tokens)


# Bodies whose answers must not depend on where the engine runs (greedy or seeded).
HI = [{"role": "user", "content": "hi"}]
SCHEMA = structured.SCHEMA
SAME_BODIES = [
    (c.COMPLETIONS_PATH, {"prompt": "Once upon a time", "max_tokens": 20, "temperature": 0, "ignore_eos": True}),
    (c.COMPLETIONS_PATH, {"prompt": "abc", "max_tokens": 30, "temperature": 0, "stop": ["ac", "nt"]}),
    (c.COMPLETIONS_PATH, {"prompt": "abc", "max_tokens": 30, "temperature": 0, "stop": ["ar"], "n": 3}),
    (
        c.COMPLETIONS_PATH,
        {"prompt": "abc", "max_tokens": 12, "stop": ["ar"], "include_stop_str_in_output": True, "temperature": 0},
    ),
    (c.COMPLETIONS_PATH, {"prompt": ["one", "two"], "max_tokens": 8, "n": 2, "seed": 4, "ignore_eos": True}),
    (c.COMPLETIONS_PATH, {"prompt": "Paris", "max_tokens": 3, "echo": True, "logprobs": 2, "temperature": 0}),
    (c.COMPLETIONS_PATH, {"prompt": "Paris", "max_tokens": 2, "prompt_logprobs": 1, "temperature": 0}),
    (
        c.COMPLETIONS_PATH,
        {"prompt": "x", "max_tokens": 10, "temperature": 0, "presence_penalty": 1.5, "repetition_penalty": 1.3},
    ),
    (c.COMPLETIONS_PATH, {"prompt": "x", "max_tokens": 40, "seed": 2, "guided_regex": "[0-9]{3}-[a-z]{2}"}),
    (c.COMPLETIONS_PATH, {"prompt": "x", "max_tokens": 60, "seed": 2, "structured_outputs": {"json": SCHEMA}}),
    (c.CHAT_COMPLETIONS_PATH, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0}),
    (
        c.CHAT_COMPLETIONS_PATH,
        {"messages": HI, "max_tokens": 6, "logprobs": True, "top_logprobs": 2, "seed": 9},
    ),
    (
        c.COMPLETIONS_PATH,
        {"prompt": "hi", "max_tokens": 6, "slo_class": "interactive", "temperature": 0, "ignore_eos": True},
    ),
]


def comparable(body: dict) -> dict:
    return {k: v for k, v in body.items() if k not in ("id", "created")}


@ON_THE_MODULE_LOOP
@pytest.mark.parametrize("path,body", SAME_BODIES)
async def test_answers_are_those_of_the_engine_on_a_thread(proc, threaded, path, body):
    body = {"model": SERVED_MODEL, **body}
    for stream in (False, True):
        answers = []
        for server in (threaded, proc):
            if stream:  # each choice's chunks in order (how choices interleave depends on timing)
                by_choice: dict[int, list[dict]] = {}
                for chunk in await api.stream(server, path, body):
                    for ch in chunk["choices"]:
                        by_choice.setdefault(ch["index"], []).append(ch)
                answers.append(by_choice)
            else:
                status, done = await api.post(server, path, body)
                assert status == 200, done
                answers.append(comparable(done))
        assert answers[0] == answers[1]


@ON_THE_MODULE_LOOP
async def test_a_stop_string_ends_the_request_in_the_engine_too(proc):
    status, plain = await api.post(
        proc, c.COMPLETIONS_PATH, {"model": SERVED_MODEL, "prompt": "abc", "max_tokens": 30, "temperature": 0}
    )
    text = plain["choices"][0]["text"]
    before = await finished(proc, "stop")
    body = {"model": SERVED_MODEL, "prompt": "abc", "max_tokens": 200, "temperature": 0, "stop": [text[4:6]]}
    body["ignore_eos"] = True
    status, done = await api.post(proc, c.COMPLETIONS_PATH, body)
    assert status == 200 and done["choices"][0]["finish_reason"] == "stop"
    assert done["choices"][0]["text"] == text[: text.index(text[4:6])]
    assert await srv.all_blocks_free(proc)  # not 200 tokens later
    assert await finished(proc, "stop") == before + 1


@ON_THE_MODULE_LOOP
async def test_a_stop_string_completed_by_the_last_token_is_a_stop(proc, threaded):
    body = {"model": SERVED_MODEL, "prompt": "abc", "max_tokens": 30, "temperature": 0, "ignore_eos": True}
    plain = (await api.post(threaded, c.COMPLETIONS_PATH, body))[1]
    stop = plain["choices"][0]["text"][4:6]
    stopped = (await api.post(threaded, c.COMPLETIONS_PATH, {**body, "stop": [stop]}))[1]
    last = {**body, "stop": [stop], "max_tokens": stopped["usage"]["completion_tokens"]}  # it ends by length too
    answers = [(await api.post(server, c.COMPLETIONS_PATH, last))[1] for server in (threaded, proc)]
    assert [a["choices"][0]["finish_reason"] for a in answers] == ["stop", "stop"]
    assert comparable(answers[0]) == comparable(answers[1])


async def finished(server: RunningServer, reason: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    async with aiohttp.ClientSession() as http, http.get(server.url + c.METRICS_PATH) as resp:
        text = await resp.text()
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == c.metric("requests_finished_total") and s.labels.get("finished_reason") == reason
    )


@ON_THE_MODULE_LOOP
async def test_metrics_come_from_the_engine_process_and_count_disconnects(proc):
    body = {"model": SERVED_MODEL, "prompt": "a long story", "max_tokens": 200, "stream": True, "ignore_eos": True}
    aborted = await finished(proc, "abort")
    async with aiohttp.ClientSession() as http:
        resp = await http.post(proc.url + c.COMPLETIONS_PATH, json=body)
        got = 0
        async for line in resp.content:
            got += line.startswith(b"data: ")
            if got == 3:
                break
        resp.close()
    assert await srv.all_blocks_free(proc)
    assert await finished(proc, "abort") == aborted + 1
    async with aiohttp.ClientSession() as http, http.get(proc.url + c.METRICS_PATH) as resp:
        text = await resp.text()
    for name in ("requests_running", "kv_cache_usage_ratio", "time_to_first_token_seconds_bucket"):
        assert c.metric(name) in text


async def test_exported_metrics_are_exactly_the_contract(monkeypatch):
    real = start_server

    async def in_a_process(cfg: EngineConfig, core=None) -> RunningServer:
        return await real(cfg.model_copy(update={"engine_process": True}), core)

    monkeypatch.setattr(srv, "start_server", in_a_process)
    await srv.test_exported_metrics_are_exactly_the_contract()


async def test_structured_output_and_tool_calls(caplog):
    running = await start_server(
        EngineConfig(
            model="tiny", served_model_name=SERVED_MODEL, device="cpu", port=0, max_model_len=1024, engine_process=True
        )
    )
    try:
        for test in (
            structured.test_json_schema_answers_always_validate,
            structured.test_vllm_guided_fields_on_completions,
            structured.test_a_schema_the_engine_cannot_follow_is_a_400,
            structured.test_ignore_eos_runs_past_the_grammars_end_on_eos_only,
        ):
            await call(test, running, caplog)
        for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
            async with openai.AsyncOpenAI(base_url=running.url + "/v1", api_key="x", max_retries=0) as client:
                await structured.test_forced_tool_calls_parse_and_validate_streamed_and_not(client, choice)
    finally:
        await running.close()


async def test_queue_bound_counts_what_the_engine_runs():
    running = await start_server(config(num_gpu_blocks=16, max_num_seqs=1, max_waiting_requests=1, engine_process=True))
    body = {"model": SERVED_MODEL, "prompt": [5, 6, 7], "max_tokens": 200, "ignore_eos": True}
    engine = running.server.engine
    try:
        async with aiohttp.ClientSession() as http:
            first = asyncio.create_task(http.post(running.url + c.COMPLETIONS_PATH, json=body))
            await srv.until(lambda: engine._counts[0] == 1)
            second = asyncio.create_task(http.post(running.url + c.COMPLETIONS_PATH, json=body))
            await srv.until(lambda: engine.num_queued == 1 and engine._counts[1] == 1)
            async with http.post(running.url + c.COMPLETIONS_PATH, json=body) as third:
                assert third.status == 503 and (await third.json())["error"]["code"] == "overloaded"
            for task in (first, second):
                task.cancel()
        assert await srv.all_blocks_free(running)
    finally:
        await running.close()


async def test_an_engine_that_cannot_start_raises_its_error():
    started = time.monotonic()
    with pytest.raises(ValueError, match="max_position_embeddings"):
        await start_server(config(max_model_len=10**6, engine_process=True))
    assert time.monotonic() - started < TIMEOUT_S


async def test_drain_then_close_stops_the_engine_process():
    running = await start_server(config(engine_process=True))
    engine = running.server.engine
    process = engine._proc
    async with openai.AsyncOpenAI(base_url=running.url + "/v1", api_key="x", max_retries=0) as client:
        task = asyncio.create_task(
            client.completions.create(model=SERVED_MODEL, prompt="x", max_tokens=40, extra_body={"ignore_eos": True})
        )
        await srv.until(lambda: engine.num_live == 1)
        await running.drain(timeout_s=60)
        assert (await task).usage.completion_tokens == 40  # drained: the live request finished
    await running.close()
    assert process.exitcode == 0 and engine.error is None


def test_serve_answers_503_and_exits_non_zero_when_the_engine_process_is_killed() -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    exe = str(Path(sys.executable).parent / "superinfer")
    argv = [exe, "serve", "--model", "tiny", "--device", "cpu", "--port", str(port), "--engine-process"]
    argv += ["--num-gpu-blocks", "300", "--max-model-len", "4096", "--torch-threads", "1"]
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        wait_ready(url, proc, timeout=TIMEOUT_S)
        long = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4000, "ignore_eos": True, "stream": True}
        results: list = []
        thread = threading.Thread(target=_post, args=(url + "/v1/completions", long, results))
        thread.start()
        deadline = time.monotonic() + TIMEOUT_S
        while not _generating(url):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        os.kill(spawned_child(proc.pid, "engine"), signal.SIGKILL)
        thread.join(TIMEOUT_S)
        assert not thread.is_alive(), "the request hung"
        status, body = results[0]
        assert status == 200 and b"the engine failed" in body and body.endswith(b"data: [DONE]\n\n")
        with pytest.raises(OSError):  # health answers 503 (HTTPError), or the server is gone already
            urllib.request.urlopen(url + c.HEALTH_PATH, timeout=10).close()
        assert proc.wait(timeout=TIMEOUT_S) == 1
        assert "the engine process exited" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _generating(url: str) -> bool:
    with urllib.request.urlopen(url + c.METRICS_PATH, timeout=10) as resp:
        text = resp.read().decode()
    return any(
        line.startswith(c.metric("generation_tokens_total")) and float(line.rsplit(" ", 1)[1]) > 0
        for line in text.splitlines()
    )


async def test_tp2_in_the_engine_process_gives_the_tokens_of_tp1():
    body = {"model": SERVED_MODEL, "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0}
    answers = []
    for overrides in ({"engine_process": True, "tensor_parallel_size": 2, "torch_threads": 1}, {}):
        running = await start_server(config(**overrides))
        try:
            status, done = await api.post(running, c.COMPLETIONS_PATH, {**body, "ignore_eos": True})
            assert status == 200, done
            answers.append(done["choices"][0]["text"])
        finally:
            await running.close()
    assert answers[0] == answers[1]


def test_the_flag_reaches_the_config() -> None:
    from superinfer.cli.main import build_parser
    from superinfer.engine.flags import engine_config

    assert engine_config(build_parser().parse_args(["serve", "--engine-process"])).engine_process
    assert not engine_config(build_parser().parse_args(["serve", "--no-engine-process"])).engine_process
    assert json.loads(EngineConfig(engine_process=True).model_dump_json())["engine_process"] is True
