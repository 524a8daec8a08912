"""The simulator: hand-checked timing, determinism, invariants, the policies' ordering under
overload, capacity planning, no torch import, and the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import yaml

from superinfer.bench.peer_loads import CLASSES
from superinfer.cli.main import main
from superinfer.engine.core.request import RequestStatus
from superinfer.engine.slo import SLO
from superinfer.operator.api.inference_service import InferenceServiceSpec
from superinfer.sim.capacity import max_rate, replicas_for
from superinfer.sim.config import SimConfig
from superinfer.sim.report import point_report
from superinfer.sim.simulator import simulate
from superinfer.workload.arrivals import WorkItem, mixed_workload, poisson_workload

SLO_TIGHT = SLO(2000.0, 100.0)


def overload(rate: float = 60.0) -> list[WorkItem]:
    return poisson_workload(rate, 5, SLO_TIGHT, seed=0, output_median=100)


@pytest.fixture
def fixed_cost(tmp_path):
    """Every step 10 ms whatever it computes, copies 1 ms per block."""
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"base_s": 0.010, "per_block_out_s": 0.001, "per_block_in_s": 0.001}))
    return path


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_fixed_step_cost_gives_the_hand_calculated_token_times(fixed_cost, async_scheduling):
    items = [WorkItem(0.0, 16, 4), WorkItem(0.5, 8, 2)]
    config = SimConfig(calibration=fixed_cost, host_s=0.0, async_scheduling=async_scheduling, policy="fcfs")
    result = simulate(config, items)
    # One prefill step, then a decode step per token; the second request arrives to an idle device.
    assert result.timings[0].token_times == pytest.approx((0.01, 0.02, 0.03, 0.04))
    assert result.timings[1].token_times == pytest.approx((0.51, 0.52))
    assert result.duration_s == pytest.approx(0.52)
    assert point_report(result)["ttft_p50_ms"] == pytest.approx(10.0)


def test_host_time_hides_behind_the_device_only_with_async_scheduling(fixed_cost):
    items = [WorkItem(0.0, 16, 4)]
    hidden = simulate(SimConfig(calibration=fixed_cost, host_s=0.004, policy="fcfs"), items)
    # The first plan takes 4 ms; later ones are made while the step before runs.
    assert hidden.timings[0].token_times == pytest.approx((0.014, 0.024, 0.034, 0.044))
    serial = simulate(SimConfig(calibration=fixed_cost, host_s=0.004, async_scheduling=False, policy="fcfs"), items)
    assert serial.timings[0].token_times == pytest.approx((0.014, 0.028, 0.042, 0.056))


def test_deterministic_for_a_seed():
    items = overload(40)
    reports = [point_report(simulate(SimConfig(policy="rotary", gpu_kv_gib=1), items)) for _ in range(2)]
    for r in reports:
        r.pop("wall_s")
    assert reports[0] == reports[1]


@pytest.mark.parametrize("policy", ["fcfs", "rotary", "watermark"])
def test_scheduler_and_kv_invariants_hold_throughout(policy):
    config = SimConfig(policy=policy, gpu_kv_gib=0.5, transfer_budget_blocks=300)
    seen = {"steps": 0, "moved": 0}

    def check(sched, plan):
        kv = sched.kv
        moved = len(plan.swap_out) + len(plan.swap_in)
        assert moved <= config.transfer_budget_blocks
        assert not {g for g, _ in plan.swap_out} & {g for _, g in plan.swap_in}  # never source and destination
        assert len(sched.running) <= config.max_num_seqs
        assert kv.pool.num_used + kv.pool.num_free + len(kv.pool.held) == kv.num_blocks
        assert min(kv.pool.ref_cnt) >= 0
        live = [*sched.running, *sched.waiting, *sched.rotary]
        assert len(live) == len({id(r) for r in live}) == len(sched.requests)
        for r in sched.rotary:
            assert r.status is RequestStatus.ROTARY and not r.block_ids
        for r in sched.running:
            assert r.status is RequestStatus.RUNNING
            assert len(r.block_ids) * kv.block_size >= r.num_computed_tokens
        seen["steps"] += 1
        seen["moved"] += moved

    result = simulate(config, overload(30), on_step=check)
    assert all(len(t.token_times) == item.output_len for t, item in zip(result.timings, overload(30), strict=True))
    assert seen["steps"] == result.steps
    if policy != "fcfs":
        assert seen["moved"] > 0


def test_rotary_beats_fcfs_on_ttft_attainment_under_overload():
    items = overload()
    fcfs = point_report(simulate(SimConfig(policy="fcfs", gpu_kv_gib=1), items))
    rotary = point_report(simulate(SimConfig(policy="rotary", gpu_kv_gib=1), items))
    assert fcfs["recomputes"] > 0 and rotary["rotations"] > 0  # the KV pool was exhausted
    assert rotary["ttft_attainment"] >= fcfs["ttft_attainment"] + 0.15
    assert rotary["swap_gb_s_cpu_to_gpu"] > 0 and fcfs["swap_gb_s_cpu_to_gpu"] == 0


def test_labelled_requests_carry_their_slo_class_and_priority():
    """A mixed workload's interactive and batch items reach the scheduler as those SLO classes,
    with their priorities: under overload rotary serves the interactive ones first."""
    items = mixed_workload(CLASSES, 40.0, 5, seed=0, max_prompt=256, max_output=512)
    seen: dict[str, tuple[str, int]] = {}

    def record(sched, plan) -> None:
        seen.update({r.request_id: (r.slo_class, r.priority) for r in sched.requests.values()})

    result = simulate(SimConfig(policy="rotary", gpu_kv_gib=0.25), items, on_step=record)
    assert {seen[f"w{i}"] for i, it in enumerate(items) if it.label == "interactive"} == {("interactive", 1)}
    assert {seen[f"w{i}"] for i, it in enumerate(items) if it.label == "batch"} == {("batch", 0)}
    ttft = {
        label: [t.ttft for it, t in zip(items, result.timings, strict=True) if it.label == label]
        for label in ("interactive", "batch")
    }
    assert sorted(ttft["interactive"])[len(ttft["interactive"]) // 2] < sorted(ttft["batch"])[len(ttft["batch"]) // 2]


def test_max_rate_bisects_a_monotonic_metric():
    calls = []

    def metric(rate):
        calls.append(rate)
        return 1.0 if rate <= 37.3 else 0.5

    found = max_rate(metric, 0.9, lo=10, hi=20, rel_tol=0.01)
    assert 37.3 * 0.99 <= found.rate <= 37.3 and found.bounded
    assert all(v >= 0.9 for r, v in found.probes if r <= found.rate)
    assert len({r for r, _ in found.probes}) == len(found.probes)  # no rate probed twice
    expanded = max_rate(metric, 0.9, lo=10, hi=20, rel_tol=0.01)
    assert [r for r, _ in expanded.probes[:3]] == [20, 40, 30]  # 20 met it: 40 next, then bisect [20, 40]
    assert max_rate(lambda r: 1.0, 0.9, lo=1, hi=2, max_expand=3).bounded is False
    assert max_rate(lambda r: 0.0, 0.9, lo=1, hi=2).rate == 0.0


def test_max_rate_of_the_simulator_grows_with_kv_memory():
    def at(kv_gib):
        config = SimConfig(policy="fcfs", gpu_kv_gib=kv_gib)

        def goodput(rate):
            items = poisson_workload(rate, 4, SLO(1000.0, 100.0), seed=0, output_median=100)
            return point_report(simulate(config, items))["goodput_share"]

        return max_rate(goodput, 0.9, lo=10, hi=80, rel_tol=0.1).rate

    small, large = at(0.25), at(2.0)
    assert 0 < small <= large


def test_replicas_for():
    assert replicas_for(100, 40) == 3
    assert replicas_for(80, 40) == 2
    assert replicas_for(1, 40) == 1
    with pytest.raises(ValueError):
        replicas_for(10, 0)


def test_the_simulator_never_imports_torch(tmp_path):
    script = textwrap.dedent(
        f"""
        import sys

        class NoTorch:
            def find_spec(self, name, path=None, target=None):
                if name == "torch" or name.startswith("torch."):
                    raise ImportError("torch is blocked")

        sys.meta_path.insert(0, NoTorch())
        from superinfer.cli.main import main
        rc = main(["simulate", "--rates", "20", "--duration", "2", "--policies", "fcfs,rotary",
                   "--gpu-kv-gib", "1", "--no-progress", "--json", {str(tmp_path / "out.json")!r}])
        assert rc == 0, rc
        assert "torch" not in sys.modules
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("ok")


def test_cli_sweep_writes_json_and_plot(tmp_path, capsys):
    out, png = tmp_path / "sim.json", tmp_path / "sim.png"
    rc = main(
        [
            "simulate",
            "--rates",
            "20,40",
            "--duration",
            "3",
            "--gpu-kv-gib",
            "1",
            "--no-progress",
            "--json",
            str(out),
            "--plot",
            str(png),
        ]
    )
    assert rc == 0
    record = json.loads(out.read_text())
    assert set(record["points"]) == {"fcfs", "rotary", "watermark"}
    point = record["points"]["rotary"][1]
    assert point["rate"] == 40
    for key in (
        "ttft_attainment",
        "tbt_attainment",
        "goodput_share",
        "ttft_p99_ms",
        "throughput_tok_s",
        "swap_gb_s_gpu_to_cpu",
        "swap_gb_s_cpu_to_gpu",
        "rotations",
    ):
        assert key in point
    assert png.stat().st_size > 0
    assert "TTFT att" in capsys.readouterr().out


def test_cli_vary_and_capacity(tmp_path, capsys):
    out = tmp_path / "cap.json"
    rc = main(
        [
            "simulate",
            "--rates",
            "10,40",
            "--duration",
            "3",
            "--gpu-kv-gib",
            "1",
            "--policies",
            "fcfs",
            "--max-rate",
            "--replicas-for",
            "100",
            "--no-progress",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    entry = json.loads(out.read_text())["capacity"]["policies"]["fcfs"]
    assert entry["max_rate"] > 0 and entry["replicas"] >= replicas_for(100, entry["max_rate"])
    # The result is printed as the InferenceService fields that hand it to the operator's autoscaler.
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("fcfs: autoscaling:"))
    fields = yaml.safe_load(line.split(": ", 1)[1])["autoscaling"]
    spec = InferenceServiceSpec.model_validate({"model": {"uri": "preset://tiny"}, "autoscaling": fields})
    assert spec.autoscaling.capacity.max_rate_per_replica == pytest.approx(entry["max_rate"], abs=0.01)
    rc = main(
        [
            "simulate",
            "--rates",
            "20",
            "--duration",
            "2",
            "--gpu-kv-gib",
            "1",
            "--policies",
            "rotary",
            "--vary",
            "alpha=1,5",
            "--no-progress",
        ]
    )
    assert rc == 0
    text = capsys.readouterr().out
    assert "rotary[alpha=1]" in text and "rotary[alpha=5]" in text
    assert main(["simulate", "--model", "nope", "--no-progress"]) == 2


def test_cli_trace_input(tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    trace.write_text(
        "".join(json.dumps({"prompt": "x" * (40 * i), "generated": "y" * 200}) + "\n" for i in range(1, 30))
    )
    out = tmp_path / "t.json"
    args = ["simulate", "--trace", str(trace), "--rates", "5", "--duration", "4", "--policies", "fcfs"]
    assert main([*args, "--burstiness", "0.5", "--no-progress", "--json", str(out)]) == 0
    point = json.loads(out.read_text())["points"]["fcfs"][0]
    assert 0 < point["requests"] <= 29
    assert point["output_tokens"] == 50 * point["requests"]  # 200 characters at 4 per token
