"""Azure LLM inference traces: the reader and writer, replaying their arrivals (speed-up, length
scale, window), `superinfer simulate --trace` on one, and the peer benchmark's trace load. Every
trace here is generated; real ones are read from a path and never committed."""

from __future__ import annotations

import datetime as dt
import gzip
import json
import math
import re
from pathlib import Path

import pytest

from superinfer.bench.peer_loads import TRACE_SLO, LoadShape, TraceLoad, figures, items
from superinfer.bench.vllm_peer import parse_args, phase_loads, trace_load, trace_markdown, trace_rows
from superinfer.cli.main import main
from superinfer.engine.slo import SLO
from superinfer.sim.workload_spec import WorkloadSpec, make_workload, trace_rate, trace_speedup
from superinfer.workload.arrivals import (
    WorkItem,
    azure_trace,
    format_stamp,
    is_arrival_trace,
    mean_rate,
    parse_azure_rows,
    stamp_seconds,
    write_azure_trace,
)
from superinfer.workload.goodput import RequestTiming

T0 = dt.datetime(2023, 11, 16, 18, 15, 46, 680590)
ARRIVALS = (0.0, 0.5, 1.25, 2.0, 3.0, 4.5, 6.0, 7.75)
ROW = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{7},\d+,\d+")


def sample_items() -> list[WorkItem]:
    return [WorkItem(t, 100 + 10 * i, 20 + i) for i, t in enumerate(ARRIVALS)]


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    return write_azure_trace(tmp_path / "AzureLLMInferenceTrace_test.csv", sample_items(), T0)


def test_the_writer_writes_the_published_format(trace: Path):
    lines = trace.read_text().splitlines()
    assert lines[0] == "TIMESTAMP,ContextTokens,GeneratedTokens"
    assert lines[1] == "2023-11-16 18:15:46.6805900,100,20"
    assert all(ROW.fullmatch(line) for line in lines[1:]), lines
    assert lines[3].startswith("2023-11-16 18:15:47.9305900,")  # 1.25 s later


def test_read_back_replays_the_trace_own_arrivals_and_lengths(trace: Path):
    got = azure_trace(trace, slo=SLO(1000.0, 100.0), label="conv")
    assert [i.arrival_s for i in got] == pytest.approx(ARRIVALS, abs=1e-6)
    assert [(i.prompt_len, i.output_len) for i in got] == [(i.prompt_len, i.output_len) for i in sample_items()]
    assert {i.slo for i in got} == {SLO(1000.0, 100.0)} and {i.label for i in got} == {"conv"}
    assert mean_rate(got) == pytest.approx((len(ARRIVALS) - 1) / ARRIVALS[-1])


def test_speedup_compresses_the_arrivals(trace: Path):
    got = azure_trace(trace, speedup=4.0)
    assert [i.arrival_s for i in got] == pytest.approx([t / 4 for t in ARRIVALS], abs=1e-6)
    assert mean_rate(got) == pytest.approx(4 * mean_rate(azure_trace(trace)))


def test_length_scale_multiplies_and_clamps_to_one_and_the_maximum(trace: Path):
    half = azure_trace(trace, length_scale=0.5)
    assert [i.prompt_len for i in half] == [round((100 + 10 * i) * 0.5) for i in range(len(ARRIVALS))]
    assert azure_trace(trace, length_scale=0.001)[0].output_len == 1
    capped = azure_trace(trace, length_scale=10.0, max_prompt=1000, max_output=210)
    assert max(i.prompt_len for i in capped) == 1000 and capped[0].prompt_len == 1000
    assert [i.output_len for i in capped][:2] == [200, 210]


def test_a_window_takes_its_rows_and_starts_at_zero(trace: Path):
    got = azure_trace(trace, start_s=1.0, duration_s=3.0)  # offsets 1.25, 2.0, 3.0 in [1, 4)
    assert [i.arrival_s for i in got] == pytest.approx([0.25, 1.0, 2.0], abs=1e-6)
    assert [i.prompt_len for i in got] == [120, 130, 140]
    fast = azure_trace(trace, start_s=1.0, duration_s=3.0, speedup=2.0)
    assert [i.arrival_s for i in fast] == pytest.approx([0.125, 0.5, 1.0], abs=1e-6)
    assert len(azure_trace(trace, start_s=6.0)) == 2  # no duration: to the end


def test_clear_errors(trace: Path, tmp_path: Path):
    with pytest.raises(ValueError, match=r"no requests in the window \[100, 110\) s of a trace that spans 7.8 s"):
        azure_trace(trace, start_s=100.0, duration_s=10.0)
    for bad in ({"speedup": 0.0}, {"speedup": -1.0}, {"length_scale": 0.0}):
        with pytest.raises(ValueError, match="must be positive"):
            azure_trace(trace, **bad)
    with pytest.raises(ValueError, match="duration > 0"):
        azure_trace(trace, duration_s=0.0)
    lengths_only = tmp_path / "other.csv"
    lengths_only.write_text("TIMESTAMP,ContextTokens\n2023-11-16 18:15:46.6805900,10\n")
    with pytest.raises(ValueError, match=r"lacks the column\(s\) GeneratedTokens"):
        azure_trace(lengths_only)
    empty = tmp_path / "empty.csv"
    empty.write_text("")
    with pytest.raises(ValueError, match="lacks the column"):
        azure_trace(empty)
    only_header = tmp_path / "header.csv"
    only_header.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n")
    with pytest.raises(ValueError, match="no rows"):
        azure_trace(only_header)
    with pytest.raises(ValueError, match="line 3: not a trace timestamp"):
        parse_azure_rows(["TIMESTAMP,ContextTokens,GeneratedTokens", "2023-11-16 18:15:46.1,1,1", "yesterday,1,1"])


def test_timestamps_with_seven_digits_offsets_and_any_order():
    assert stamp_seconds("2023-11-16 18:15:46.6805900") - stamp_seconds("2023-11-16 18:15:46") == pytest.approx(0.68059)
    assert stamp_seconds("2023-11-17 00:00:00") - stamp_seconds("2023-11-16 23:59:59.5") == pytest.approx(0.5)
    assert stamp_seconds("2024-05-10 02:00:00+02:00") == stamp_seconds("2024-05-10 00:00:00Z")
    assert format_stamp(T0) == "2023-11-16 18:15:46.6805900"
    header = "ContextTokens,TIMESTAMP,GeneratedTokens"  # columns found by name
    rows = parse_azure_rows([header, "5,2023-11-16 18:15:48.0,1", "7,2023-11-16 18:15:47.0,2"])
    assert [r[1] for r in rows] == [7, 5]  # sorted by arrival


def test_gzipped_traces_and_which_paths_replay_arrivals(tmp_path: Path, trace: Path):
    packed = tmp_path / "trace.csv.gz"
    packed.write_bytes(gzip.compress(trace.read_bytes()))
    assert len(azure_trace(packed)) == len(ARRIVALS)
    assert is_arrival_trace(packed) and is_arrival_trace(Path("x.CSV"))
    assert not is_arrival_trace(Path("sharegpt.json")) and not is_arrival_trace(Path("t.jsonl"))


def test_the_simulated_workload_compresses_the_trace_to_a_rate(trace: Path):
    spec = WorkloadSpec(trace=trace, trace_speedup=2.0, length_scale=0.5, max_prompt=60)
    base = trace_rate(spec)
    assert base == pytest.approx(2 * (len(ARRIVALS) - 1) / ARRIVALS[-1])
    same = make_workload(spec, base)
    assert [i.arrival_s for i in same] == pytest.approx([t / 2 for t in ARRIVALS], abs=1e-6)
    assert {i.prompt_len for i in same} == {50, 55, 60}
    assert [i.arrival_s for i in make_workload(spec, 3 * base)] == pytest.approx([t / 6 for t in ARRIVALS], abs=1e-6)
    assert trace_speedup(spec, 3 * base) == pytest.approx(6.0)


def test_simulate_replays_a_trace_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    work = [WorkItem(0.2 * i, 64 + 8 * (i % 5), 16 + (i % 7)) for i in range(40)]
    path = write_azure_trace(tmp_path / "trace.csv", work, T0)
    out = tmp_path / "sim.json"
    args = ["simulate", "--trace", str(path), "--trace-speedup", "2", "--length-scale", "0.5", "--trace-start", "1"]
    assert main([*args, "--policies", "fcfs,rotary", "--gpu-kv-gib", "1", "--no-progress", "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    for label in ("fcfs", "rotary"):
        (point,) = record["points"][label]
        assert point["requests"] == 35  # offsets 1.0 .. 7.8 s
        assert point["rate"] == pytest.approx(10.0) and point["trace_speedup"] == pytest.approx(2.0)
        assert point["output_tokens"] == sum(round(w.output_len * 0.5) for w in work[5:])
        assert point["ttft_attainment"] == 1.0
    assert record["workload"]["trace_speedup"] == 2.0
    text = capsys.readouterr().out
    assert "35 requests at 10.00 req/s" in text
    for column in ("TBT att+stall", "TBT p99 att", "worst gap p99 ms", "stall>1s", "goodput+stall", "goodput p99"):
        assert column in text
    assert "10 (x2)" in text

    assert main(["simulate", "--trace", str(path), "--rates", "20", "--policies", "fcfs", "--no-progress"]) == 0
    assert "20 (x4)" in capsys.readouterr().out  # 39 gaps over 7.8 s: 5 req/s at x1
    assert main(["simulate", "--trace", str(path), "--trace-start", "100", "--no-progress"]) == 2
    assert "no requests in the window" in capsys.readouterr().err
    assert main(["simulate", "--trace-speedup", "2", "--no-progress"]) == 2
    assert "replay a CSV --trace" in capsys.readouterr().err


def test_the_peer_trace_load(trace: Path):
    shape = LoadShape(trace=TraceLoad(trace, length_scale=0.5, duration_s=None))
    work = items("trace", shape, seed=3)
    assert [i.arrival_s for i in work] == pytest.approx(ARRIVALS, abs=1e-6)
    assert {i.slo for i in work} == {TRACE_SLO} and SLO(1000.0, 100.0) == TRACE_SLO
    assert shape.quick().trace == shape.trace
    with pytest.raises(ValueError, match="--trace PATH"):
        items("trace", LoadShape(), seed=0)

    timings = [RequestTiming(i.arrival_s, (i.arrival_s + 0.2, i.arrival_s + 0.25), i.slo) for i in work]
    timings[0] = RequestTiming(0.0, (1.5, 1.55), work[0].slo)  # past the TTFT SLO
    figs = figures("trace", work, timings, 10.0, rotations=4.0, preemptions=0.0)
    assert figs["ttft_attainment"] == pytest.approx(7 / 8) and figs["goodput_rps"] == pytest.approx(0.7)
    assert figs["stalled_1s_share"] == 0.0 and figs["rotations_per_request"] == 0.5
    assert math.isclose(figs["worst_gap_p99_ms"], 50.0)

    rows = trace_rows({"rotary@1": {"trace": {k: [v] for k, v in figs.items()}}}, ["rotary@1"])
    assert ("trace: TTFT attainment", ["88%"]) in rows
    assert trace_markdown(rows, ["rotary@1"]).startswith(
        "| | `rotary@1` |\n|---|---|\n| trace: TTFT attainment | 88% |"
    )


def test_the_peer_flags_pick_the_trace_load(trace: Path):
    args = parse_args(
        ["--trace", str(trace), "--phases", "tight", "--loads", "trace", "--quick", "--trace-speedup", "2"]
    )
    load = trace_load(args)
    assert load is not None and load.duration_s == 15.0 and load.speedup == 2.0
    assert phase_loads("tight", args.loads, trace=True) == ["trace"]
    assert phase_loads("tight", None, trace=False) == ["hol", "poisson"]
    assert phase_loads("ample", None, trace=True) == ["batch1", "saturation"]
    assert trace_load(parse_args([])) is None
    with pytest.raises(SystemExit):
        parse_args(["--loads", "trace"])  # no --trace
