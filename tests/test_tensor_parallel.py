"""Tensor parallelism on the CPU (gloo): each rank's weights are its part of the one-device
model's, `-tp 2` generates the tokens `-tp 1` does (dense and MoE, with prefix caching, chunked
prefill and rotation), and a worker that dies ends the engine with an error instead of a hang."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from superinfer.engine.config import EngineConfig
from superinfer.engine.core.request import SamplingParams
from superinfer.engine.engine import AsyncEngine, EngineCore, EngineDeadError
from superinfer.engine.model import load_model, preset_config
from superinfer.engine.model.moe import grouped_experts, route
from superinfer.engine.model.sharding import TensorParallel, check_fits
from tests.hf_fixtures import make_hf_checkpoint
from tests.test_cli import free_port, wait_ready

TIMEOUT_S = 120  # for anything that could hang if a rank were lost


# --- the weights each rank holds (no processes) -------------------------------------------------
@pytest.fixture(scope="module")
def mixtral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Top-2 of 4 experts, 4 query and 2 KV heads (see hf_fixtures)."""
    return make_hf_checkpoint("mixtral", tmp_path_factory.mktemp("mixtral"), seed=7)


def _parts_equal_whole(spec: str, size: int, **load: object) -> None:
    whole = dict(load_model(spec, **load).model.checkpoint_tensors())
    for rank in range(size):
        shard = load_model(spec, tp=TensorParallel(rank, size), **load).model
        held = 0
        for t in shard.sharded_tensors():
            if t.view is None:
                continue
            held += 1
            part = t.part(whole[t.name])
            mine = t.view if t.shard is None else t.view.narrow(t.shard.dim, 0, t.shard.length)
            assert torch.equal(mine, part), f"rank {rank}: {t.name}"
            if t.shard is not None and t.view.shape[t.shard.dim] > t.shard.length:  # vocabulary padding
                padding = t.view.narrow(t.shard.dim, t.shard.length, t.view.shape[t.shard.dim] - t.shard.length)
                assert not padding.any()
        assert held


@pytest.mark.parametrize("size", [2, 4])  # 4 ranks: one query head each, the 2 KV heads replicated
@pytest.mark.parametrize("dummy", [False, True], ids=["checkpoint", "dummy"])
def test_each_rank_holds_its_part_of_the_tiny_model(size: int, dummy: bool) -> None:
    _parts_equal_whole("tiny", size, dummy=dummy)


def test_each_rank_holds_its_experts_and_a_padded_vocabulary(tmp_path: Path) -> None:
    path = make_hf_checkpoint("qwen3_moe", tmp_path / "m", seed=3, vocab_size=3075)  # 3075 = 2 x 1538 - 1
    _parts_equal_whole(str(path), 2)
    _parts_equal_whole(str(path), 2, dummy=True)
    shard = load_model(str(path), tp=TensorParallel(1, 2)).model
    assert shard.model.layers[0].mlp.w13.shape[0] == 4  # 8 experts, whole
    assert shard.lm_head.weight.shape[0] == 1538


def test_kv_heads_follow_the_query_heads() -> None:
    cfg = preset_config("llama-3-8b")  # 32 query heads, 8 KV heads
    for size, expected in ((2, [(0, 4), (4, 4)]), (16, [(r // 2, 1) for r in range(16)])):
        shards = [TensorParallel(r, size).kv_heads(cfg.num_kv_heads) for r in range(size)]
        assert [(s.start, s.length) for s in shards] == expected
        group = cfg.num_heads // cfg.num_kv_heads
        for r, s in enumerate(shards):  # every query head of the rank reads one of its KV heads
            q = TensorParallel(r, size).split(cfg.num_heads)
            assert {h // group for h in range(q.start, q.start + q.length)} <= set(range(s.start, s.start + s.length))


def test_experts_split_over_ranks_add_up_to_all_experts() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(21, 16, generator=gen)
    w13, w2 = torch.randn(6, 40, 16, generator=gen) / 4, torch.randn(6, 16, 20, generator=gen) / 4
    weights, ids = route(torch.randn(21, 6, generator=gen), 2, renormalize=True)
    split = sum(grouped_experts(x, w13[e : e + 2], w2[e : e + 2], weights, ids, first=e) for e in (0, 2, 4))
    torch.testing.assert_close(split, grouped_experts(x, w13, w2, weights, ids), atol=1e-6, rtol=1e-5)


def test_a_model_that_cannot_be_split_names_the_fields() -> None:
    with pytest.raises(ValueError, match="num_attention_heads 4 is not divisible by 3") as err:
        EngineCore(EngineConfig(model="tiny", device="cpu", tensor_parallel_size=3))  # before any process starts
    assert "num_key_value_heads 2" in str(err.value) and "intermediate_size 688" in str(err.value)
    with pytest.raises(ValueError, match=r"num_experts 8 .* not divisible by 3"):
        check_fits(preset_config("mixtral-8x7b"), 3)


# --- tp=2 against tp=1 ----------------------------------------------------------------------------
# Few GPU blocks, no residency or admission control: rotations all the time (see test_rotary); 32
# tokens per step: prompts prefill in chunks; prompts share prefixes: prefix cache hits.
PRESSURE = {
    "policy": "rotary",
    "num_gpu_blocks": 24,
    "num_cpu_blocks": 400,
    "transfer_budget_blocks": 16,
    "rotary_min_residency_ms": 0,
    "slo_admission": False,
    "max_num_batched_tokens": 32,
    "max_model_len": 256,
}
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def _prompts(n: int, seed: int) -> dict[str, list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 3000) for _ in range(40)]
    return {
        f"r{i}": (shared if i % 2 else []) + [rng.randrange(3, 3000) for _ in range(rng.randint(5, 60))]
        for i in range(n)
    }


def _run(core: EngineCore, prompts: dict[str, list[int]], sampling: SamplingParams) -> dict[str, list]:
    for rid, prompt in prompts.items():
        core.add_request(rid, prompt, sampling)
    out: dict[str, list] = {rid: [] for rid in prompts}
    deadline = time.monotonic() + TIMEOUT_S
    while core.has_work:
        assert time.monotonic() < deadline, "the engine did not finish"
        out_step = core.step()
        for o in out_step:
            out[o.request_id].append(o)
    return out


def _tokens(outputs: dict[str, list]) -> dict[str, list[int]]:
    return {rid: [t for o in outs for t in o.token_ids] for rid, outs in outputs.items()}


@pytest.fixture(scope="module", params=["dense", "moe"])
def engines(request: pytest.FixtureRequest, mixtral: Path):
    """(tp=1, tp=2) engines of one model under the same pressure; the MoE pair schedules
    asynchronously (placeholders filled from the broadcast tokens on every rank)."""
    model, extra = ("tiny", {}) if request.param == "dense" else (str(mixtral), {"async_scheduling": True})
    config = {"model": model, "device": "cpu", "dtype": "float32", "torch_threads": 1, **PRESSURE, **extra}
    one = EngineCore(EngineConfig(**config))
    two = EngineCore(EngineConfig(**config, tensor_parallel_size=2))
    yield one, two
    two.close()


def test_tp2_generates_the_tokens_of_tp1(engines) -> None:
    one, two = engines
    prompts = _prompts(10, seed=1)
    want = _tokens(_run(one, prompts, GREEDY))
    got = _run(two, prompts, GREEDY)
    assert _tokens(got) == want
    counters = two.scheduler.counters
    assert counters.rotations > 0, "rotations happened"
    assert max(len(p) for p in prompts.values()) > PRESSURE["max_num_batched_tokens"], "chunked prefills happened"
    assert any(outs[0].num_cached_tokens for outs in got.values()), "prefix cache hits happened"
    assert two.kv.pool.num_free == two.kv.num_blocks


def test_tp2_logprobs_are_those_of_tp1(engines) -> None:
    one, two = engines
    sampling = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    prompts = _prompts(3, seed=2)
    want, got = _run(one, prompts, sampling), _run(two, prompts, sampling)
    assert _tokens(got) == _tokens(want)
    for rid in prompts:
        for a, b in zip(want[rid], got[rid], strict=True):
            assert a.logprobs[0].logprob == pytest.approx(b.logprobs[0].logprob, abs=1e-4)
            assert [t for t, _ in a.logprobs[0].top] == [t for t, _ in b.logprobs[0].top]
        first_a, first_b = want[rid][0].prompt_logprobs, got[rid][0].prompt_logprobs
        assert len(first_a) == len(first_b) == len(prompts[rid])
        for a, b in zip(first_a[1:], first_b[1:], strict=True):
            assert a.token_id == b.token_id and abs(a.rank - b.rank) <= 2  # unlikely tokens' ranks are close calls
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)


# --- a worker that dies -------------------------------------------------------------------------------
async def test_a_worker_dying_while_idle_fails_the_engine_at_once(engines) -> None:
    """The last test of each pair: it kills the tp=2 engine's worker."""
    core = engines[1]
    engine = AsyncEngine(core)
    await engine.start()
    try:
        core.workers.procs[0].kill()
        await asyncio.wait_for(engine.died.wait(), TIMEOUT_S)
        assert "rank 1" in str(engine.error)
        with pytest.raises(EngineDeadError):
            await anext(engine.generate("late", [5, 6, 7], GREEDY))
    finally:
        await asyncio.wait_for(engine.stop(), TIMEOUT_S)
    assert not core.workers.alive


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":\t", 1) for line in stat.read_text().splitlines() if ":\t" in line)
        except OSError:
            continue  # gone meanwhile
        if int(fields.get("PPid", "0")) == pid:
            found.append(int(stat.parent.name))
    return found


def spawned_child(server_pid: int, what: str) -> int:
    """The process the server spawned (a worker rank, or the engine process)."""
    for child in _children(server_pid):
        with open(f"/proc/{child}/cmdline", "rb") as f:
            if b"spawn_main" in f.read():  # not the resource tracker
                return child
    raise AssertionError(f"no {what} process found")


def _post(url: str, body: dict, results: list) -> None:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as resp:
            results.append((resp.status, resp.read()))
    except urllib.error.HTTPError as err:
        results.append((err.code, err.read()))


def test_serve_answers_503_and_exits_non_zero_when_a_worker_is_killed_mid_request() -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    exe = str(Path(sys.executable).parent / "superinfer")
    argv = [exe, "serve", "--model", "tiny", "--device", "cpu", "--port", str(port), "-tp", "2"]
    argv += ["--num-gpu-blocks", "300", "--max-model-len", "4096", "--torch-threads", "1"]
    argv += ["--no-engine-process"]  # the worker is then the server's own child (the engine process: its tests)
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        wait_ready(url, proc, timeout=TIMEOUT_S)
        long = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4000, "ignore_eos": True}
        results: list = []
        thread = threading.Thread(target=_post, args=(url + "/v1/completions", long, results))
        thread.start()
        deadline = time.monotonic() + TIMEOUT_S
        while not _generating(url):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        os.kill(spawned_child(proc.pid, "tensor-parallel worker"), signal.SIGKILL)
        thread.join(TIMEOUT_S)
        assert not thread.is_alive(), "the request hung"
        status, body = results[0]
        assert status == 503 and "tensor-parallel" in json.loads(body)["error"]["message"]
        assert proc.wait(timeout=TIMEOUT_S) == 1
        assert "the engine failed" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _generating(url: str) -> bool:
    """Whether the server's engine is running a request."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        lines = resp.read().decode().splitlines()
    gauges = [line for line in lines if line.startswith("superinfer_engine_requests_running{")]
    return bool(gauges) and float(gauges[0].rsplit(" ", 1)[1]) > 0  # no sample before the first step
