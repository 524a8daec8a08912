"""The SLO autoscaler judges TBT with stalls: a class whose streams freeze past their stall budget
is in distress even while its p90 gap and the attainment look fine."""

from __future__ import annotations

import math
from dataclasses import replace

from superinfer.engine.contract import metric
from superinfer.operator.autoscaling.class_pressure import STALLED_SHARE_LIMIT
from superinfer.operator.autoscaling.decision import decide
from superinfer.operator.autoscaling.pod_metrics import ClassStats, Window, parse
from tests.operator.test_operator_autoscaler import FAST, SLOW_BATCH, WARM, P, obs, two_classes

HEALTHY_LONG = replace(WARM, healthy_since=-1e9)


def test_a_class_whose_streams_freeze_scales_up_though_its_p90_is_fine():
    # Interactive: p90 TBT 40 ms of 100 and attainment 0.95 (above the 0.9 target), but 2 of its
    # 40 streams stopped for longer than their stall budget: users saw two hung answers.
    frozen = replace(FAST, attainment=0.95, stalled=2)
    d = decide(obs(2, s=two_classes(frozen, SLOW_BATCH, attainment=0.99)), P, WARM)
    assert (d.action, d.reason, d.target) == ("ScaleUp", "SLODistress", 3)
    assert d.message.startswith("5.0% of requests stalled past the stall budget > 1% (class interactive)")
    assert "batch" not in d.message


def test_stalls_within_the_share_and_thin_classes_are_no_distress():
    # One stall in 200 requests is within the share; the service consolidates as it would without.
    rare = replace(SLOW_BATCH, stalled=1)
    assert rare.stalled / rare.requests <= STALLED_SHARE_LIMIT
    light = two_classes(FAST, replace(rare, ttft_p90_ms=900, tbt_p90_ms=60), running=4, tbt_mean_ms=40)
    assert decide(obs(2, s=light), P, HEALTHY_LONG).action == "ScaleDown"
    # A class with fewer than minRequests finished requests is not judged on its stalls either.
    thin = ClassStats(requests=P.min_requests - 1, attainment=0.9, ttft_p90_ms=200, tbt_p90_ms=40, stalled=5)
    assert decide(obs(2, s=two_classes(thin, SLOW_BATCH)), P, WARM).action == "Hold"


def test_the_worst_class_drives_the_step():
    # Half of batch's streams stall: ~2x the replicas, capped at maxStepPercent (2x) as any distress.
    frozen = replace(SLOW_BATCH, stalled=80)
    d = decide(obs(2, s=two_classes(FAST, frozen)), P, WARM)
    assert (d.action, d.target) == ("ScaleUp", 4)
    assert "50.0% of requests stalled" in d.message and "(class batch)" in d.message


def stall_page(met: float, stalled: dict[str, float]) -> str:
    """A page with `met` requests of class chat, all met, and each class's stalled-stream count."""
    slo, stalls = metric("slo_requests") + "_total", metric("stalled_requests") + "_total"
    lines = [f"# TYPE {slo} counter", f'{slo}{{model_name="m",ttft="met",tbt="met",slo_class="chat"}} {met}']
    lines.append(f"# TYPE {stalls} counter")
    lines += [f'{stalls}{{model_name="m",slo_class="{cls}"}} {n}' for cls, n in stalled.items()]
    return "\n".join(lines) + "\n"


def test_the_window_counts_stalled_streams_per_class_from_the_pods():
    w = Window(seconds=60)
    w.add("a", parse(stall_page(100, {"chat": 3}), now=0))
    w.add("a", parse(stall_page(150, {"chat": 6}), now=30))
    w.add("b", parse(stall_page(40, {"chat": 2}), now=0))
    w.add("b", parse(stall_page(10, {"chat": 1}), now=30))  # restarted: counts from zero
    s = w.stats(now=31, fresh_seconds=10)
    assert s is not None and s.requests == 50 + 10
    assert s.classes["chat"].stalled == 3 + 1
    assert math.isclose(s.classes["chat"].stalled / s.classes["chat"].requests, 4 / 60)
    d = decide(obs(2, s=replace(s, pods=2, tbt_p90_ms=40, ttft_p90_ms=200)), P, WARM)
    assert d.action == "ScaleUp" and "6.7% of requests stalled" in d.message and "(class chat)" in d.message
