"""bench.vllm_peer without vLLM: workloads, settings matching, counters, the table, and our server as
a real subprocess under a tiny load (vLLM itself never runs in tests: CI has none)."""

from __future__ import annotations

import asyncio
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest

from superinfer.bench import server_process
from superinfer.bench.peer_loads import CLASSES, LoadShape, figures, items
from superinfer.bench.peer_settings import (
    Contender,
    Matched,
    ServerCommand,
    cpu_list,
    superinfer_command,
    vllm_command,
)
from superinfer.bench.peer_table import cell, markdown, rows, spread, versus_vllm
from superinfer.bench.server_process import Launch, free_port, serving
from superinfer.bench.vllm_peer import load_seed, measure, parse_counters, requests
from superinfer.engine.model.tiny import ensure_tiny_model
from superinfer.engine.slo import SLO
from superinfer.workload.arrivals import RequestClass, burst_workload, mixed_workload
from superinfer.workload.goodput import RequestTiming
from superinfer.workload.loadgen import chunk_tokens

# --- workloads ------------------------------------------------------------------------------------


def test_mixed_workload_is_seeded_labelled_and_follows_the_shares():
    a = mixed_workload(CLASSES, rate=20.0, duration_s=50.0, seed=3, max_prompt=512, max_output=512)
    assert a == mixed_workload(CLASSES, rate=20.0, duration_s=50.0, seed=3, max_prompt=512, max_output=512)
    assert a != mixed_workload(CLASSES, rate=20.0, duration_s=50.0, seed=4, max_prompt=512, max_output=512)
    assert all(0 < it.arrival_s <= 50.0 for it in a)
    assert [it.arrival_s for it in a] == sorted(it.arrival_s for it in a)
    by_label = {c.label: [it for it in a if it.label == c.label] for c in CLASSES}
    assert sum(map(len, by_label.values())) == len(a)
    share = len(by_label["interactive"]) / len(a)
    assert 0.62 < share < 0.78  # 70% of ~1000 arrivals
    for c in CLASSES:
        assert all(it.slo == c.slo for it in by_label[c.label])
        assert all(4 <= it.prompt_len <= 512 and 4 <= it.output_len <= 512 for it in by_label[c.label])
    mean_output = {k: sum(it.output_len for it in v) / len(v) for k, v in by_label.items()}
    assert mean_output["batch"] > 2 * mean_output["interactive"]  # the classes keep their own lengths


def test_mixed_workload_rejects_classes_without_weight():
    none = RequestClass("x", 0.0, SLO(), 10, 10)
    with pytest.raises(ValueError):
        mixed_workload([none], rate=1.0, duration_s=1.0)
    with pytest.raises(ValueError):
        mixed_workload([], rate=1.0, duration_s=1.0)


def test_burst_workload_labels_long_and_short_and_takes_long_prompts_apart():
    slo = SLO(1000.0, 100.0)
    work = burst_workload(slo, seed=1, long_requests=6, burst=40, long_prompt_len=(160, 224), long_output=384)
    assert [it.label for it in work] == ["long"] * 6 + ["short"] * 40
    assert all(160 <= it.prompt_len <= 224 and it.output_len == 384 for it in work[:6])
    assert all(16 <= it.prompt_len <= 64 for it in work[6:])
    assert all(it.arrival_s >= 0.5 for it in work[6:])
    # without long_prompt_len the demo's load is what it was: long prompts from prompt_len
    assert all(16 <= it.prompt_len <= 64 for it in burst_workload(slo, seed=1))


def test_peer_loads_are_deterministic_per_seed_and_shaped():
    shape = LoadShape()
    for load in ("batch1", "saturation", "hol", "poisson"):
        assert items(load, shape, 7) == items(load, shape, 7)
    sat = items("saturation", shape, 1)
    assert len(sat) == 64 and all(it.arrival_s == 0 for it in sat)
    assert {it.prompt_len for it in sat} >= {32, 96}
    assert items("saturation", shape, 1) != items("saturation", shape, 2)  # another order
    assert sum(it.label == "short" for it in items("hol", shape, 0)) == 40
    assert len(items("batch1", shape.quick(), 0)) == 4
    seeds = {load_seed(0, run, load) for run in range(3) for load in ("batch1", "saturation", "hol", "poisson")}
    assert len(seeds) == 12  # no two loads or runs share prompts


def test_requests_carry_the_sampling_fields_beside_a_structured_constraint():
    work = items("saturation", LoadShape(), 0)
    reqs = requests(work, 3072, 0, structured_share=0.5, sampling={"temperature": 0.7, "top_p": 0.9})
    assert all(r.fields["temperature"] == 0.7 and r.fields["top_p"] == 0.9 for r in reqs)
    assert sum("structured_outputs" in r.fields for r in reqs) == len(reqs) // 2
    assert all(r.fields == {} for r in requests(work, 3072, 0))  # greedy: the client's default body


# --- settings matching ----------------------------------------------------------------------------


def flag(argv: tuple[str, ...], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_vllm_gets_one_block_more_than_ours_for_its_null_block(tmp_path: Path):
    m = Matched(tmp_path / "model", num_blocks=48)
    ours = superinfer_command("/x/superinfer", m, 9000, "rotary", 2, cpu_blocks=500)
    theirs = vllm_command(str(tmp_path / "venv" / "bin" / "python"), m, 9001, 1)
    assert flag(ours.argv, "--num-gpu-blocks") == "48"
    assert flag(theirs.argv, "--num-gpu-blocks-override") == "49"
    for name in ("--block-size", "--max-model-len", "--max-num-seqs", "--max-num-batched-tokens", "--dtype"):
        assert flag(ours.argv, name) == flag(theirs.argv, name)
    assert flag(ours.argv, "--block-size") == "32"
    assert flag(ours.argv, "--model") == flag(theirs.argv, "--model") == str(m.model_dir)
    assert {"--enable-chunked-prefill", "--enable-prefix-caching"} <= set(theirs.argv)
    assert theirs.argv[1:3] == ("-m", "vllm.entrypoints.openai.api_server")
    assert flag(ours.argv, "--num-cpu-blocks") == "500"
    assert "--num-cpu-blocks" not in superinfer_command("/x/superinfer", m, 9000, "fcfs", 2, cpu_blocks=500).argv
    assert not {"--engine-process", "--no-engine-process"} & set(ours.argv)  # the server's default
    assert superinfer_command("s", m, 1, "fcfs", 1, engine_process=True).argv[-1] == "--engine-process"
    assert superinfer_command("s", m, 1, "fcfs", 1, engine_process=False).argv[-1] == "--no-engine-process"


def test_threads_and_preloads(tmp_path: Path):
    m = Matched(tmp_path, num_blocks=8)
    assert cpu_list(1) == "0" and cpu_list(2) == "0-1"
    assert superinfer_command("s", m, 1, "fcfs", 1).env == {"OMP_NUM_THREADS": "1"}
    python = tmp_path / "venv" / "bin" / "python"
    env = vllm_command(str(python), m, 1, 2).env
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert "libiomp5" not in env.get("LD_PRELOAD", "")  # only files that exist
    (tmp_path / "venv" / "lib").mkdir(parents=True)
    (tmp_path / "venv" / "lib" / "libiomp5.so").write_bytes(b"")
    assert str(tmp_path / "venv" / "lib" / "libiomp5.so") in vllm_command(str(python), m, 1, 2).env["LD_PRELOAD"]


def test_contender_names():
    assert Contender.parse("vllm@2") == Contender("vllm", 2) and Contender("vllm", 2).is_vllm
    assert Contender.parse(" rotary@1").name == "rotary@1"
    proc = Contender.parse("fcfs@1+proc")
    assert proc == Contender("fcfs", 1, "proc") and proc.name == "fcfs@1+proc" and proc.engine_process is True
    assert Contender.parse("rotary@2+thread").engine_process is False and Contender("fcfs", 1).engine_process is None
    for bad in ("rotary", "sglang@1", "fcfs@0", "fcfs@x", "fcfs@1+fork", "vllm@1+proc"):
        with pytest.raises(ValueError):
            Contender.parse(bad)


# --- measuring ------------------------------------------------------------------------------------


def test_chunk_tokens_counts_merged_chunks_by_their_running_usage():
    plain = {"choices": [{"text": "a"}]}
    assert chunk_tokens(plain, 0) == 1
    merged = {"choices": [{"text": "abc"}], "usage": {"completion_tokens": 4}}
    assert chunk_tokens(merged, 1) == 3
    assert chunk_tokens({"choices": [], "usage": {"completion_tokens": 4}}, 4) == 0  # the final usage chunk
    assert chunk_tokens({"choices": [{"text": ""}], "usage": {"completion_tokens": 4}}, 4) == 0


METRICS = """\
# TYPE superinfer_engine_rotations_total counter
superinfer_engine_rotations_total{model_name="tiny"} 12.0
# TYPE superinfer_engine_preemptions_total counter
superinfer_engine_preemptions_total{mode="recompute",model_name="tiny"} 3.0
superinfer_engine_preemptions_total{mode="swap",model_name="tiny"} 5.0
# TYPE superinfer_engine_scheduler_step_seconds histogram
superinfer_engine_scheduler_step_seconds_count{model_name="tiny",phase="schedule"} 41.0
superinfer_engine_scheduler_step_seconds_count{model_name="tiny",phase="update"} 40.0
superinfer_engine_scheduler_step_seconds_sum{model_name="tiny",phase="schedule"} 0.25
superinfer_engine_scheduler_step_seconds_sum{model_name="tiny",phase="update"} 0.5
"""
VLLM_METRICS = """\
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="tiny"} 7.0
# TYPE vllm:iteration_tokens_total histogram
vllm:iteration_tokens_total_count{engine="0",model_name="tiny"} 25.0
"""


def test_counters_from_metrics_pages():
    assert parse_counters(METRICS, vllm=False) == (12.0, 3.0, 40.0, {"schedule": 0.25, "update": 0.5})
    assert parse_counters(VLLM_METRICS, vllm=True) == (None, 7.0, 25.0, {})


def timing(arrival: float, first: float, gap: float, n: int, slo: SLO) -> RequestTiming:
    return RequestTiming(arrival, tuple(first + gap * i for i in range(n)), slo)


def test_hol_figures_judge_the_short_requests_only():
    slo = SLO(1000.0, 100.0)
    work = burst_workload(slo, seed=0, long_requests=2, burst=4)
    # longs start at once; two shorts make their 1 s TTFT, two wait 3 s
    timings = [timing(0, 0.01, 0.01, 24, slo)] * 2 + [timing(0, 0.2, 0.01, 4, slo)] * 2
    timings += [timing(0, 3.0, 0.01, 4, slo)] * 2
    figs = figures("hol", work, timings, duration_s=4.0, rotations=9.0, preemptions=1.0)
    assert figs["short_ttft_attainment"] == 0.5
    assert figs["rotations"] == 9.0 and figs["preemptions"] == 1.0
    assert figs["output_tok_s"] == (2 * 24 + 4 * 4) / 4.0
    assert "rotations" not in figures("hol", work, timings, 4.0, rotations=None, preemptions=0.0)


def test_saturation_figures_count_the_requests_whose_gaps_broke_tbt():
    slo = SLO()  # the server's default: TBT 100 ms
    work = items("saturation", LoadShape(saturation_requests=4), 0)
    # the third request waits 250 ms between two of its tokens (a long prefill step)
    smooth = [timing(0, 0.1, 0.01, 8, slo)] * 2
    stalled = RequestTiming(0, (0.1, 0.11, 0.36, 0.37), slo)
    figs = figures("saturation", work, [*smooth, stalled, *smooth[:1]], 1.0, None, 0.0)
    assert figs["tbt_attainment"] == 0.75
    assert figs["tbt_p99_ms"] > slo.tbt_ms  # one gap in 24 is 250 ms


def test_poisson_figures_per_class_and_rotations_per_request():
    work = mixed_workload(CLASSES, rate=4.0, duration_s=5.0, seed=0)
    slow = {"interactive": 0.7, "batch": 0.7}  # TTFT 700 ms: misses interactive (500), meets batch (10 s)
    timings = [timing(it.arrival_s, it.arrival_s + slow[it.label], 0.02, 8, it.slo) for it in work]
    figs = figures("poisson", work, timings, duration_s=10.0, rotations=len(work) * 2.0, preemptions=0.0)
    assert figs["interactive_ttft_attainment"] == 0.0 and figs["batch_ttft_attainment"] == 1.0
    batch_share = sum(it.label == "batch" for it in work) / len(work)
    assert figs["goodput_share"] == pytest.approx(batch_share)
    assert figs["goodput_rps"] == pytest.approx(batch_share * len(work) / 10.0)
    assert figs["rotations_per_request"] == 2.0 and figs["requests"] == len(work)


# --- the table ------------------------------------------------------------------------------------


def test_spread_and_cells():
    assert spread([3.0, 1.0, 2.0]) == {"min": 1.0, "median": 2.0, "max": 3.0, "runs": [3.0, 1.0, 2.0]}
    assert spread([math.nan, 4.0])["median"] == 4.0
    assert math.isnan(spread([math.nan])["median"])
    assert cell([0.5, 1.0, 0.75], "{:.0%}") == "75% (50–100%)"
    assert cell([2.0], "{:.1f}") == "2.0" and cell([2.0, 2.0], "{:.1f}") == "2.0"
    assert cell(None, "{:.1f}") == "–" and cell([math.nan], "{:.1f}") == "n/a"


def test_rows_markdown_and_versus_vllm():
    results = {
        "vllm@1": {"saturation": {"output_tok_s": [100.0, 120.0, 110.0]}},
        "fcfs@1": {"saturation": {"output_tok_s": [220.0, 220.0, 220.0]}},
        "rotary@2": {"saturation": {"output_tok_s": [50.0]}},
        "fcfs@1+proc": {"saturation": {"output_tok_s": [330.0]}},
    }
    names = ["vllm@1", "fcfs@1", "rotary@2", "fcfs@1+proc"]
    table = rows(results, names)
    assert [label for label, _ in table][:2] == ["saturation: output tok/s", "saturation: TPOT p50 (ms)"]
    assert all(label.startswith("saturation: ") for label, _ in table)
    assert table[0][1] == ["110 (100–120)", "220", "50", "330"]
    assert table[1][1] == ["–", "–", "–", "–"]
    md = markdown(results, names).splitlines()
    assert md[0] == "| | `vllm@1` | `fcfs@1` | `rotary@2` | `fcfs@1+proc` |" and len(md) == 2 + len(table)
    assert versus_vllm(results, names) == {  # no vllm@2
        "fcfs@1": {"saturation_output_tok_s_ratio": 2.0},
        "fcfs@1+proc": {"saturation_output_tok_s_ratio": 3.0},
    }


# --- our server as a real process -----------------------------------------------------------------


@pytest.mark.parametrize("engine", [None, "proc"])
def test_superinfer_serves_a_tiny_load_as_a_subprocess_and_is_stopped(tmp_path: Path, engine: str | None):
    m = Matched(ensure_tiny_model(), num_blocks=16, max_model_len=256, max_num_seqs=8)
    port = free_port()
    superinfer = str(Path(sys.executable).parent / "superinfer")
    contender = Contender("rotary", 1, engine)
    cmd = superinfer_command(superinfer, m, port, "rotary", 1, engine_process=contender.engine_process)
    launch = Launch(cmd, port, tmp_path / "ours.log")
    shape = LoadShape(batch1_requests=2, batch1_prompt=16, batch1_output=6)
    procs: list[subprocess.Popen] = []

    async def run() -> dict[str, float]:
        async with serving([launch], timeout_s=60, procs=procs) as (url,):
            return await measure(url, m.served_name, contender, "batch1", shape, 0, 3072, pid=procs[0].pid)

    figs = asyncio.run(run())
    assert figs["preemptions"] == 0 and figs["tpot_p50_ms"] > 0 and figs["output_tok_s"] > 0
    assert 0 <= figs["server_cpu_cores"] <= figs["cpu_cores"] and figs["cpu_cores"] > 0  # 10 ms ticks
    with pytest.raises(OSError):  # the server is gone once the block exits
        asyncio.run(asyncio.open_connection("127.0.0.1", port))


def test_cpu_seconds_count_the_children():
    """A parent of its own (not pytest, whose other children come and go) with one busy child:
    the parent's total beyond its own CPU time is the child's."""
    busy = "import sys, time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\nsys.stdin.read()"
    spawn = (
        "import subprocess, sys\n"
        f"child = subprocess.Popen([sys.executable, '-c', {busy!r}], stdin=sys.stdin)\n"
        "print(child.pid, flush=True)\n"
        "child.wait()"
    )
    parent = subprocess.Popen([sys.executable, "-c", spawn], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        child_pid = int(parent.stdout.readline())
        deadline = time.monotonic() + 30
        while True:
            own, total = server_process.cpu_seconds(parent.pid)
            if total - own >= 0.3:  # the child is done spinning: idle on its stdin
                break
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert server_process.cpu_seconds(child_pid)[0] == pytest.approx(total - own, abs=0.02)
    finally:
        parent.stdin.close()
        parent.wait()


def test_a_server_that_exits_fails_fast_with_its_log(tmp_path: Path):
    cmd = ServerCommand((sys.executable, "-c", "print('no model here'); raise SystemExit(3)"), {})

    async def run() -> None:
        async with serving([Launch(cmd, free_port(), tmp_path / "bad.log")], timeout_s=60):
            pass

    with pytest.raises(RuntimeError, match="no model here"):
        asyncio.run(run())


def test_a_server_that_never_answers_times_out_and_is_killed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    cmd = ServerCommand((sys.executable, "-c", "import time; time.sleep(60)"), {})
    procs: list[subprocess.Popen] = []
    real_start = server_process.start

    def start(cmd: ServerCommand, log_path: Path) -> subprocess.Popen:
        procs.append(real_start(cmd, log_path))
        return procs[-1]

    monkeypatch.setattr(server_process, "start", start)

    async def run() -> None:
        async with serving([Launch(cmd, free_port(), tmp_path / "mute.log")], timeout_s=1.0):
            pass

    with pytest.raises(TimeoutError):
        asyncio.run(run())
    assert procs[0].poll() is not None  # stopped, not left running


def test_batch1_latency_per_token_survives_merged_chunks():
    slo = SLO()
    streamed = timing(0.0, 0.01, 0.002, 10, slo)  # one token every 2 ms
    merged = RequestTiming(0.0, (0.028,) * 10, slo)  # the same tokens, all in one chunk at the end
    work = items("batch1", LoadShape(batch1_requests=1), 0)
    a = figures("batch1", work, [streamed], 1.0, None, 0.0)
    b = figures("batch1", work, [merged], 1.0, None, 0.0)
    assert a["ms_per_token_p50"] == pytest.approx(b["ms_per_token_p50"]) == pytest.approx(2.8)
    assert b["tpot_p50_ms"] == 0.0 and a["tpot_p50_ms"] == pytest.approx(2.0)


def test_engine_split_shares_of_the_engine_and_the_event_loop():
    from superinfer.bench.engine_split import ThreadTimes, split

    before = {(10, 10): ThreadTimes(1.0, 0.0), (10, 11): ThreadTimes(5.0, 1.0), (10, 12): ThreadTimes(0.0, 0.0)}
    after = {
        (10, 10): ThreadTimes(1.2, 0.1),  # the event loop
        (10, 11): ThreadTimes(6.8, 1.1),  # the engine thread: 1.8 s on a CPU, 0.1 s waiting for one
        (10, 12): ThreadTimes(0.05, 0.0),
        (10, 13): ThreadTimes(9.0, 0.0),  # started during the run: left out
    }
    shares = split(10, before, after, wall=2.0)
    assert shares["engine_on_cpu"] == pytest.approx(0.9) and shares["engine_waiting_for_cpu"] == pytest.approx(0.05)
    assert shares["engine_blocked"] == pytest.approx(0.05) and shares["loop_on_cpu"] == pytest.approx(0.1)
    assert shares["cores"] == pytest.approx((0.2 + 1.8 + 0.05) / 2.0) and shares["engine_in_child"] == 0.0
    child = {**before, (20, 20): ThreadTimes(0.0, 0.0)}
    later = {**after, (20, 20): ThreadTimes(1.9, 0.0)}  # an engine process's main thread
    assert split(10, child, later, wall=2.0)["engine_in_child"] == 1.0
