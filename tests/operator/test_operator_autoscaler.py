"""decide() on scripted metric windows, the latency model, and /metrics parsing and windowing."""

from __future__ import annotations

import itertools
import logging
import math
from dataclasses import replace

import pytest

from superinfer.engine.contract import metric
from superinfer.operator.api.inference_service import InferenceServiceSpec, SLOClassSpec, SLOStatus
from superinfer.operator.autoscaling.decision import (
    Memory,
    Observation,
    Params,
    consolidation,
    decide,
    scale_up_target,
)
from superinfer.operator.autoscaling.latency_model import DEFAULT_PRIOR, LatencyModel, Line, fit_line, predict_ttft
from superinfer.operator.autoscaling.pod_metrics import (
    ClassStats,
    Window,
    WindowStats,
    histogram_quantile,
    parse,
    pooled,
)
from superinfer.operator.controller.kube_client import Kube
from superinfer.operator.controller.scaling_tick import memory_status, record, restore, tick
from superinfer.operator.controller.state import Config, Scaler, State

SPEC = InferenceServiceSpec.model_validate(
    {
        "model": {"uri": "preset://tiny"},
        "engine": {"maxNumSeqs": 64},
        "slo": {"ttftMs": 1000, "tbtMs": 100, "attainmentTarget": 0.9},
        "autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 6, "initialDelaySeconds": 60,
                        "minRequests": 20, "scaleUp": {"cooldownSeconds": 30},
                        "scaleDown": {"stabilizationSeconds": 300, "sensitivity": 0.8}},
    }
)  # fmt: skip
P = Params.from_spec(SPEC)
T0 = 1000.0
WARM = Memory(started_at=T0 - 3600)


def stats(**kw) -> WindowStats:
    base = dict(pods=1, span_seconds=120, requests=200, attainment=0.99, ttft_attainment=0.99, ttft_p90_ms=300,
                tbt_p90_ms=40, tbt_mean_ms=35, running=8, waiting=0, rotary=0, kv_gpu=0.5, kv_cpu=0.0,
                swap_gbps=0.0)  # fmt: skip
    base.update(kw)
    return WindowStats(**base)


def obs(replicas: int = 2, now: float = T0, pending: int = 0, unschedulable: int = 0, **kw) -> Observation:
    s = kw.pop("s") if "s" in kw else stats(pods=replicas, **kw)
    return Observation(now=now, replicas=replicas, ready=replicas - pending, pending=pending,
                       unschedulable=unschedulable, stats=s)  # fmt: skip


def test_burst_scales_up_proportionally_capped_at_double():
    d = decide(obs(2, attainment=0.5), P, WARM)
    assert (d.action, d.target, d.reason, d.apply) == ("ScaleUp", 4, "SLODistress", True)
    assert "attainment 0.50 < 0.90" in d.message
    assert d.memory.last_scale_at == T0
    # Ratio 0.9/0.2 = 4.5 would want 9 from 2; the step is capped at 2x.
    assert decide(obs(2, attainment=0.2), P, WARM).target == 4
    # And at maxReplicas.
    assert decide(obs(4, attainment=0.2), P, WARM).target == 6


def test_scale_up_step_percent_and_minimum_of_one():
    half = replace(P, max_step_percent=50)
    assert scale_up_target(4, 3.0, half) == 6
    assert scale_up_target(1, 1.01, P) == 2  # always at least one more
    assert scale_up_target(1, 1.01, half) == 2


def test_queue_saturation_scales_up_before_any_request_finishes():
    # Nothing finished yet (TTFT so long), but requests pile up: that is distress too.
    d = decide(obs(1, requests=0, attainment=None, ttft_p90_ms=None, running=16, waiting=40), P, WARM)
    assert d.action == "ScaleUp" and d.target == 2
    assert "queued" in d.message


def test_latency_quantiles_over_slo_count_as_distress():
    d = decide(obs(2, attainment=0.95, tbt_p90_ms=180), P, WARM)
    assert d.action == "ScaleUp" and "p90 TBT 180ms > 100ms" in d.message
    d = decide(obs(2, attainment=0.95, ttft_p90_ms=2500), P, WARM)
    assert d.action == "ScaleUp" and d.target == 4  # 2.5x over, capped at 2x


def test_high_gpu_kv_usage_alone_is_not_distress_under_rotation():
    d = decide(obs(2, kv_gpu=0.99, kv_cpu=0.3, rotary=12), P, WARM)
    assert d.action == "Hold"
    d = decide(obs(2, kv_gpu=0.99, kv_cpu=0.99, waiting=3), P, WARM)
    assert d.action == "ScaleUp" and "KV tiers both full" in d.message


def test_pending_pods_count_as_capacity_on_the_way():
    # 2 ready pods at attainment 0.6 want 0.9/0.6 = 1.5x: 3 replicas, and 4 are already ordered.
    d = decide(obs(4, pending=2, attainment=0.6), P, WARM)
    assert (d.action, d.reason, d.target) == ("Hold", "PodsPending", 4)
    assert d.scaling.status == "True"
    # At 0.3 they want 3x: 6 replicas, more than the 4 ordered, so it stacks (+100% of 4 at most).
    d = decide(obs(4, pending=2, attainment=0.3), P, WARM)
    assert (d.action, d.target) == ("ScaleUp", 6)
    assert "4 (2 still starting) → 6" in d.message
    # The cooldown still spaces scale-ups, and a healthy window never scales down while pods start.
    assert decide(obs(4, pending=2, attainment=0.3), P, replace(WARM, last_scale_at=T0 - 10)).reason == "Cooldown"
    healthy_long = replace(WARM, healthy_since=T0 - 1000)
    assert decide(obs(4, pending=1, running=2), P, healthy_long).reason == "PodsPending"


def test_a_backlog_on_some_pods_is_not_a_reason_for_more_pods():
    # 4 ready pods: a burst left 400 requests queued on two of them; the other two have room and
    # tokens flow within TBT. New pods would get new requests, not that backlog: hold.
    backlog = stats(pods=4, attainment=0.4, waiting=400, running=64, pods_with_room=2)
    d = decide(obs(4, s=backlog), P, WARM)
    assert (d.action, d.reason) == ("Hold", "BacklogNotCapacity")
    assert "2 of 4 ready pod(s)" in d.message
    # One pod with room is not half: scale up.
    assert decide(obs(4, s=replace(backlog, pods_with_room=1)), P, WARM).action == "ScaleUp"
    # Pods too slow (p90 TBT over target) need company whatever queues.
    assert decide(obs(4, s=replace(backlog, tbt_p90_ms=180)), P, WARM).action == "ScaleUp"
    # After a burst: nothing waits anywhere, the window still counts the burst's late requests.
    after = stats(pods=4, attainment=0.4, ttft_p90_ms=80000, running=8, pods_with_room=4)
    assert decide(obs(4, s=after), P, WARM).reason == "BacklogNotCapacity"


def test_no_capacity_stops_scale_up():
    d = decide(obs(4, pending=2, unschedulable=2, attainment=0.3), P, WARM)
    assert (d.action, d.reason) == ("Hold", "InsufficientCapacity")
    assert (d.scaling.status, d.scaling.reason) == ("False", "InsufficientCapacity")


def test_stale_or_missing_metrics_hold():
    d = decide(obs(2, s=None), P, WARM)
    assert (d.action, d.reason) == ("Hold", "MetricsStale")
    assert (d.metrics.status, d.slo.status) == ("False", "Unknown")
    stale = replace(obs(2, attainment=0.1), fresh=False)
    assert decide(stale, P, WARM).reason == "MetricsStale"  # even a bad-looking window is not trusted


def test_initial_delay_and_too_few_requests():
    young = Memory(started_at=T0 - 10)
    assert decide(obs(2, attainment=0.1), P, young).reason == "InitialDelay"
    d = decide(obs(2, requests=5, attainment=0.2), P, WARM)
    assert (d.action, d.reason, d.slo.status) == ("Hold", "TooFewRequests", "Unknown")


def test_cooldown_and_at_max():
    recent = replace(WARM, last_scale_at=T0 - 10)
    assert decide(obs(2, attainment=0.5), P, recent).reason == "Cooldown"
    assert decide(obs(6, attainment=0.5), P, WARM).reason == "AtMaxReplicas"


def test_bounds_are_enforced_immediately():
    d = decide(obs(9), P, WARM)
    assert (d.action, d.target, d.reason) == ("ScaleDown", 6, "Bounds")


def test_advisory_mode_records_without_applying():
    advisory = replace(P, advisory=True)
    d = decide(obs(2, attainment=0.5), advisory, WARM)
    assert (d.action, d.target, d.apply) == ("ScaleUp", 4, False)
    assert d.memory.last_scale_at is None  # nothing was done, so no cooldown starts
    assert d.scaling.reason == "Advisory"


def test_slow_decline_removes_one_replica_after_stabilization():
    mem = WARM
    now = T0
    actions = []
    for _ in range(25):  # 25 ticks of 15 s: light, healthy load on 4 replicas
        d = decide(obs(4, now=now, running=4), P, mem)
        actions.append((d.action, d.reason))
        mem, now = d.memory, now + 15
    downs = [i for i, (a, _) in enumerate(actions) if a == "ScaleDown"]
    assert downs == [20], actions  # exactly once, after 300 s of health; then it stabilizes again
    assert actions[0] == ("Hold", "Stabilizing")


def test_two_to_one_consolidation_check_prevents_flapping():
    # 2 replicas each at batch 48 of 64: one replica would need batch 96 > capacity. Hold.
    busy = obs(2, now=T0, running=96, tbt_mean_ms=60, tbt_p90_ms=70, ttft_p90_ms=400)
    healthy_long = replace(WARM, healthy_since=T0 - 1000)
    d = decide(busy, P, healthy_long)
    assert (d.action, d.reason) == ("Hold", "ConsolidationUnsafe")
    assert "with 1 replica(s)" in d.message
    # Light load: one replica is predicted to cope, so it consolidates.
    light = obs(2, now=T0, running=4, tbt_mean_ms=20, tbt_p90_ms=25, ttft_p90_ms=150)
    d = decide(light, P, healthy_long)
    assert (d.action, d.target) == ("ScaleDown", 1)


# ---- SLO classes ---------------------------------------------------------------------------
# SPEC sets no classes, so the engine's built-ins apply: interactive 500/100 ms, batch 30000/1000 ms,
# and default = slo.ttftMs/tbtMs (1000/100 ms).


def two_classes(interactive: ClassStats, batch: ClassStats, **kw) -> WindowStats:
    """A window of interactive and batch traffic whose pooled p90s are batch's (most requests)."""
    pooled_ttft = max(interactive.ttft_p90_ms or 0, batch.ttft_p90_ms or 0)
    pooled_tbt = max(interactive.tbt_p90_ms or 0, batch.tbt_p90_ms or 0)
    return stats(requests=interactive.requests + batch.requests, ttft_p90_ms=pooled_ttft, tbt_p90_ms=pooled_tbt,
                 classes={"interactive": interactive, "batch": batch}, **kw)  # fmt: skip


FAST = ClassStats(requests=40, attainment=1.0, ttft_p90_ms=200, tbt_p90_ms=40)
SLOW_BATCH = ClassStats(requests=160, attainment=1.0, ttft_p90_ms=12000, tbt_p90_ms=250)  # within 30 s / 1 s


def test_a_slow_class_within_its_own_slo_is_no_distress():
    s = two_classes(FAST, SLOW_BATCH)
    d = decide(obs(2, s=s), P, WARM)
    assert (d.action, d.reason) == ("Hold", "Stabilizing")
    # The same window judged as one pooled class against slo.ttftMs would scale up for nothing.
    pooled_only = replace(s, classes={})
    assert decide(obs(2, s=pooled_only), P, WARM).action == "ScaleUp"


def test_a_class_over_its_own_target_scales_up_and_is_named():
    late = replace(FAST, ttft_p90_ms=900)  # under slo.ttftMs (1000) but over interactive's 500
    d = decide(obs(2, s=two_classes(late, SLOW_BATCH)), P, WARM)
    assert (d.action, d.reason, d.target) == ("ScaleUp", "SLODistress", 4)  # 1.8x over: 2 -> 4
    assert d.message.startswith("p90 TTFT 900ms > 500ms (class interactive)")
    assert "batch" not in d.message
    # The worst class drives the step and comes first in the message.
    choppy = replace(SLOW_BATCH, tbt_p90_ms=1300)
    d = decide(obs(4, s=two_classes(late, choppy)), P, WARM)
    assert d.target == 6 and d.message.startswith("p90 TTFT 900ms > 500ms (class interactive); p90 TBT 1300ms")


def test_targets_come_from_the_engine_then_the_spec_then_the_default_class():
    exported = replace(FAST, ttft_p90_ms=900, ttft_target_ms=1200, tbt_target_ms=100)  # the engine says 1200
    assert decide(obs(2, s=two_classes(exported, SLOW_BATCH)), P, WARM).action == "Hold"
    custom = Params.from_spec(SPEC.model_copy(update={"slo": SPEC.slo.model_copy(
        update={"classes": {"chat": SLOClassSpec(ttft_ms=300, tbt_ms=50)}})}))  # fmt: skip
    chat = replace(FAST, ttft_p90_ms=400)
    d = decide(obs(2, s=stats(classes={"chat": chat})), custom, WARM)
    assert d.action == "ScaleUp" and "p90 TTFT 400ms > 300ms (class chat)" in d.message
    # A class neither the engine nor the spec knows is held to the default class's targets.
    d = decide(obs(2, s=stats(classes={"other": replace(FAST, ttft_p90_ms=1100)})), custom, WARM)
    assert "p90 TTFT 1100ms > 1000ms (class other)" in d.message


def test_a_class_with_too_few_requests_is_not_judged_on_its_p90():
    thin = ClassStats(requests=P.min_requests - 1, attainment=0.9, ttft_p90_ms=3000, tbt_p90_ms=40)
    assert decide(obs(2, s=two_classes(thin, SLOW_BATCH)), P, WARM).action == "Hold"


def test_consolidation_holds_each_class_to_its_own_targets():
    healthy_long = replace(WARM, healthy_since=T0 - 1000)
    # Light load; batch answers in 900 ms: under its 0.8 x 30 s, though over 0.8 x slo.ttftMs (1000 ms).
    brisk_batch = replace(SLOW_BATCH, ttft_p90_ms=900, tbt_p90_ms=60)
    light = two_classes(FAST, brisk_batch, running=4, tbt_mean_ms=40)
    d = decide(obs(2, s=light), P, healthy_long)
    assert (d.action, d.target) == ("ScaleDown", 1)
    assert "class batch" in d.message and "limit 24000" in d.message
    # Pooled and held to slo.ttftMs, the same window would refuse to consolidate.
    d = decide(obs(2, s=replace(light, classes={})), P, healthy_long)
    assert d.reason == "ConsolidationUnsafe"
    # Interactive near its 500 ms: the survivors' queueing would push it past 0.8 x 500 ms.
    edgy = replace(FAST, ttft_p90_ms=380)
    d = decide(obs(2, s=two_classes(edgy, brisk_batch, running=40, tbt_mean_ms=40)), P, healthy_long)
    assert (d.action, d.reason) == ("Hold", "ConsolidationUnsafe")
    assert d.message.startswith("with 1 replica(s), predicted: class interactive p90 TBT")
    assert "(limit 400)" in d.message.split(";")[0]


def plant(replicas: int, load: float) -> WindowStats:
    """A toy serving system: `load` concurrent sequences spread over replicas; TBT grows with batch."""
    batch = load / replicas
    tbt = DEFAULT_PRIOR.at(batch) * 4000  # ms, ~50 ms at batch 8 .. ~ 120 ms at batch 120
    waiting = max(0.0, batch - 64) * replicas
    over = tbt > 100 or waiting > 0
    return stats(pods=replicas, running=min(batch, 64) * replicas, waiting=waiting, tbt_mean_ms=tbt * 0.9,
                 tbt_p90_ms=tbt, attainment=0.6 if over else 0.98)  # fmt: skip


@pytest.mark.parametrize("load", [40, 150, 300])
def test_closed_loop_on_a_toy_plant_settles_without_flapping(load):
    mem, n, now, model = WARM, 1, T0, LatencyModel()
    history = []
    for _ in range(200):
        s = plant(n, load)
        model.observe(s.running / n, s.tbt_mean_ms / 1000)
        d = decide(Observation(now, n, n, 0, 0, s), P, mem, model)
        mem, now = d.memory, now + 15
        if d.apply:
            n = d.target
        history.append(n)
    tail = history[-100:]
    assert len(set(tail)) == 1, f"not settled: {tail}"
    final = plant(tail[0], load)
    assert final.attainment >= P.target  # the SLO holds where it settled
    changes = sum(1 for a, b in itertools.pairwise(history) if a != b)
    assert changes <= 4, history


# ---- latency model ----------------------------------------------------------------------------


def test_fit_line_recovers_a_line_and_respects_the_prior_when_data_is_thin():
    truth = Line(0.02, 0.001)
    points = [(x, truth.at(x)) for x in (4 + i * 116 / 64 for i in range(64))]  # a full model memory
    fitted = fit_line(points, DEFAULT_PRIOR)
    assert fitted.a == pytest.approx(0.02, abs=0.004) and fitted.b == pytest.approx(0.001, rel=0.1)
    empty = fit_line([], DEFAULT_PRIOR)
    assert (empty.a, empty.b) == pytest.approx((DEFAULT_PRIOR.a, DEFAULT_PRIOR.b))
    assert fit_line([(10, 0.5)], DEFAULT_PRIOR).b >= 0


def test_predictions():
    model = LatencyModel()
    for x in (8, 16, 32, 64):
        model.observe(x, 0.01 + 0.001 * x)
    assert model.predict_tbt(16, 32, 0.026) > 0.026
    assert predict_ttft(0.2, 0.5, 0.99) == math.inf
    assert predict_ttft(0.2, 0.5, 0.75) == pytest.approx(0.4)


# ---- scraping and windows ---------------------------------------------------------------------


# The engine labels SLO verdicts and latency histograms by SLO class; pages split every count over two.
CLASS_SHARES = {"interactive": 0.25, "default": 0.75}


def page(met: float, missed: float, ttft_le: dict[float, float], running: float = 3, model: str = "m") -> str:
    lines = [f"# TYPE {metric('slo_requests')}_total counter"]
    for cls, share in CLASS_SHARES.items():
        lines += [
            f'{metric("slo_requests")}_total{{model_name="{model}",ttft="met",tbt="met",slo_class="{cls}"}} '
            f"{met * share}",
            f'{metric("slo_requests")}_total{{model_name="{model}",ttft="missed",tbt="met",slo_class="{cls}"}} '
            f"{missed * share}",
        ]
    lines.append(f"# TYPE {metric('time_to_first_token_seconds')} histogram")
    for cls, share in CLASS_SHARES.items():
        for le, count in ttft_le.items():
            le_text = "+Inf" if math.isinf(le) else str(le)
            labels = f'model_name="{model}",slo_class="{cls}",le="{le_text}"'
            lines.append(f"{metric('time_to_first_token_seconds')}_bucket{{{labels}}} {count * share}")
    lines += [
        f"# TYPE {metric('requests_running')} gauge",
        f'{metric("requests_running")}{{model_name="{model}"}} {running}',
        f"# TYPE {metric('kv_cache_usage_ratio')} gauge",
        f'{metric("kv_cache_usage_ratio")}{{model_name="{model}",tier="gpu"}} 0.7',
    ]
    return "\n".join(lines) + "\n"


def test_parse_reads_the_contract_names():
    snap = parse(page(10, 2, {0.1: 4, 1.0: 12, math.inf: 12}), now=5.0)
    assert pooled(snap.slo) == {("met", "met"): 10, ("missed", "met"): 2}
    assert snap.slo[("interactive", "met", "met")] == 2.5
    assert pooled(snap.ttft_buckets)[1.0] == 12 and snap.running == 3 and snap.kv_usage == {"gpu": 0.7}
    assert parse(page(10, 2, {}), now=0, model_name="other").slo == {}


def test_histogram_quantile_interpolates_like_prometheus():
    buckets = {0.1: 50.0, 0.5: 90.0, 1.0: 100.0, math.inf: 100.0}
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.1)
    assert histogram_quantile(0.9, buckets) == pytest.approx(0.5)
    assert histogram_quantile(0.95, buckets) == pytest.approx(0.75)
    assert histogram_quantile(0.9, {}) is None


def test_window_deltas_across_pods_with_a_counter_reset():
    w = Window(seconds=60)
    w.add("a", parse(page(100, 0, {1.0: 100, math.inf: 100}), now=0))
    w.add("a", parse(page(160, 40, {1.0: 190, math.inf: 200}), now=30))
    w.add("b", parse(page(500, 0, {1.0: 500, math.inf: 500}), now=0))
    w.add("b", parse(page(9, 1, {1.0: 10, math.inf: 10}), now=30))  # restarted: counts from zero
    s = w.stats(now=31, fresh_seconds=10)
    assert s.pods == 2 and s.requests == 60 + 40 + 10
    assert s.attainment == pytest.approx((60 + 9) / 110)
    assert s.running == 6 and s.kv_gpu == pytest.approx(0.7)
    assert s.ttft_p90_ms is not None and s.ttft_p90_ms > 0


def test_window_drops_old_snapshots_and_stale_pods():
    w = Window(seconds=60)
    for t in range(0, 300, 15):
        w.add("a", parse(page(t, 0, {}), now=t))
    s = w.stats(now=290, fresh_seconds=30)
    assert s.requests == 285 - 225  # only the last 60 s
    assert w.stats(now=400, fresh_seconds=30) is None  # nothing fresh: the caller holds
    w.forget_missing([])
    assert w.series == {}


def class_page(classes: dict[str, tuple[float, dict[float, float], tuple[float, float]]], model: str = "m") -> str:
    """A page whose classes each have (requests all met, TTFT buckets, (ttft, tbt) targets in seconds)."""
    slo, ttft, target = metric("slo_requests"), metric("time_to_first_token_seconds"), metric("slo_target_seconds")
    lines = [f"# TYPE {slo}_total counter"]
    lines += [f'{slo}_total{{model_name="{model}",ttft="met",tbt="met",slo_class="{c}"}} {n}'
              for c, (n, _, _) in classes.items()]  # fmt: skip
    lines.append(f"# TYPE {ttft} histogram")
    for c, (_, buckets, _) in classes.items():
        for le, count in buckets.items():
            le_text = "+Inf" if math.isinf(le) else str(le)
            lines.append(f'{ttft}_bucket{{model_name="{model}",slo_class="{c}",le="{le_text}"}} {count}')
    lines.append(f"# TYPE {target} gauge")
    for c, (_, _, (t_ttft, t_tbt)) in classes.items():
        lines.append(f'{target}{{model_name="{model}",kind="ttft",slo_class="{c}"}} {t_ttft}')
        lines.append(f'{target}{{model_name="{model}",kind="tbt",slo_class="{c}"}} {t_tbt}')
    return "\n".join(lines) + "\n"


BATCH_BUCKETS = {1.0: 0, 10.0: 5, 30.0: 100, math.inf: 100}  # slow: p90 between 10 and 30 s
QUICK_BUCKETS = {0.1: 80, 0.5: 100, 1.0: 100, math.inf: 100}


def test_parse_keeps_classes_and_their_targets():
    snap = parse(
        class_page({"batch": (100, BATCH_BUCKETS, (30, 1)), "interactive": (100, QUICK_BUCKETS, (0.5, 0.1))}), 0
    )
    assert snap.targets == {("batch", "ttft"): 30, ("batch", "tbt"): 1, ("interactive", "ttft"): 0.5,
                            ("interactive", "tbt"): 0.1}  # fmt: skip
    assert snap.ttft_buckets[("batch", 10.0)] == 5 and snap.ttft_buckets[("interactive", 0.1)] == 80
    # Series without the label (an engine from before classes) belong to the default class.
    unlabelled = page(10, 2, {1.0: 12, math.inf: 12}).replace(',slo_class="interactive"', "")
    unlabelled = unlabelled.replace(',slo_class="default"', "")
    assert {c for c, _, _ in parse(unlabelled, 0).slo} == {"default"}


def test_window_gives_each_class_its_p90_and_targets():
    w = Window(seconds=60)
    for pod, ttft_target in (("a", 0.5), ("b", 0.4)):  # b already runs a stricter interactive class
        w.add(pod, parse(class_page({"interactive": (0, {0.1: 0, math.inf: 0}, (ttft_target, 0.1))}), now=0))
        grown = {"batch": (100, BATCH_BUCKETS, (30, 1)), "interactive": (100, QUICK_BUCKETS, (ttft_target, 0.1))}
        w.add(pod, parse(class_page(grown), now=30))
    s = w.stats(now=31, fresh_seconds=10)
    assert s.requests == 400 and set(s.classes) == {"batch", "interactive"}
    batch, quick = s.classes["batch"], s.classes["interactive"]
    assert batch.requests == 200 and 10_000 < batch.ttft_p90_ms < 30_000 and batch.ttft_target_ms == 30_000
    assert quick.ttft_p90_ms == pytest.approx(300) and quick.ttft_target_ms == pytest.approx(400)  # strictest pod
    assert s.ttft_p90_ms > 10_000  # pooled over both classes: batch's
    # Batch within its 30 s and interactive within 400 ms: nothing to scale for.
    d = decide(obs(2, s=replace(s, pods=2)), P, WARM)
    assert d.action == "Hold", d.message


def test_status_lists_each_class_beside_the_targets_it_is_held_to():
    scaler = Scaler(memory=WARM, window=Window(seconds=120))
    s = two_classes(replace(FAST, ttft_target_ms=450), SLOW_BATCH)
    record(scaler, decide(obs(2, s=s), P, WARM), T0, 2, s, P)
    status = SLOStatus.model_validate(scaler.slo_status)  # what the CRD's status schema accepts
    assert status.ttft_ms == 12000 and status.classes is not None
    by_name = {c.name: c for c in status.classes}
    assert (by_name["interactive"].ttft_ms, by_name["interactive"].ttft_target_ms) == (200, 450)  # the engine's
    assert (by_name["batch"].ttft_ms, by_name["batch"].ttft_target_ms, by_name["batch"].requests) == (12000, 30000, 160)


async def test_tick_leaves_an_invalid_service_alone():
    async def no_login():
        raise AssertionError("an invalid service must not reach the API")

    state = State(config=Config(login=no_login), kube=Kube(no_login))
    spec = {**SPEC.dump(), "kvCache": {"cpuOffload": {"size": "512Gi"}}}  # passes the schema, not the check
    owner = {"metadata": {"namespace": "ns", "name": "big"}, "spec": spec}
    assert await tick(state, owner, logging.getLogger("test")) is None
    assert state.scalers == {}


def test_another_writer_of_replicas_holds_an_active_autoscaler_until_it_goes_quiet():
    mine = replace(WARM, applied_replicas=2)
    d = decide(obs(3, attainment=0.5), P, mine)  # distress, but someone (an HPA) just set 3
    assert (d.action, d.reason, d.apply) == ("Hold", "ExternalWriter", False)
    assert d.scaling.status == "False" and "from 2 to 3 by another writer" in d.scaling.message
    assert "Advisory" in d.scaling.message  # says how to resolve it
    assert (d.memory.applied_replicas, d.memory.external_write_at) == (3, T0)
    quiet = P.stabilization_seconds
    assert decide(obs(3, attainment=0.5, now=T0 + quiet - 1), P, d.memory).reason == "ExternalWriter"
    resumed = decide(obs(3, attainment=0.5, now=T0 + quiet + 1), P, d.memory)
    assert (resumed.action, resumed.apply, resumed.memory.applied_replicas) == ("ScaleUp", True, resumed.target)


def test_advisory_mode_leaves_replicas_to_other_writers():
    advisory = replace(P, advisory=True)
    d = decide(obs(3, attainment=0.5), advisory, replace(WARM, applied_replicas=2))
    assert (d.action, d.reason, d.apply) == ("ScaleUp", "SLODistress", False)


def test_the_first_decision_adopts_the_replicas_it_finds():
    d = decide(obs(2), P, WARM)
    assert d.reason != "ExternalWriter" and d.memory.applied_replicas == 2


def test_memory_survives_a_round_trip_through_status():
    memory = Memory(started_at=T0, last_scale_at=T0 + 60, healthy_since=T0 + 120, applied_replicas=3,
                    external_write_at=T0 + 30)  # fmt: skip
    model = LatencyModel()
    model.observe(4.0, 0.02)
    model.observe(9.5, 0.031)
    saved = {"history": [{"action": "ScaleUp"}], "lastDecision": {"action": "Hold"}, **memory_status(memory, model)}
    scaler = Scaler(memory=Memory(started_at=T0 + 9999), window=Window(seconds=120))
    restore(scaler, saved)
    assert scaler.memory == memory
    assert list(scaler.model.points) == [(4.0, 0.02), (9.5, 0.031)]
    assert scaler.status["history"] == [{"action": "ScaleUp"}]


def test_a_capacity_profile_sizes_scale_ups():
    # 200 requests in 120 s = 1.67 req/s; attainment 0.85 < 0.9 asks for 2 → 3 proportionally.
    assert decide(obs(2, attainment=0.85), P, WARM).target == 3
    profiled = replace(P, max_rate_per_replica=0.45)  # the profile says 1.67 req/s needs 4
    d = decide(obs(2, attainment=0.85), profiled, WARM)
    assert (d.action, d.target) == ("ScaleUp", 4) and "capacity profile: 1.67 req/s needs 4" in d.message
    assert decide(obs(2, attainment=0.85), replace(P, max_rate_per_replica=0.1), WARM).target == 4  # ≤ 2×


def test_a_capacity_profile_checks_scale_downs_unless_the_measurements_prove_it_wrong():
    healthy_long = replace(WARM, healthy_since=T0 - 1000)
    light = dict(running=4, tbt_mean_ms=20, tbt_p90_ms=25, ttft_p90_ms=150)  # the latency model says 1 copes
    assert decide(obs(2, **light), replace(P, max_rate_per_replica=2.0), healthy_long).action == "ScaleDown"
    d = decide(obs(2, **light), replace(P, max_rate_per_replica=1.0), healthy_long)  # 1.67 req/s > 1 replica
    assert (d.action, d.reason) == ("Hold", "OverCapacityProfile")
    assert "needs 2 replica(s)" in d.message
    # Two replicas already meet the SLO at 0.83 req/s each, above the profile's 0.5: it is wrong, so advisory.
    d = decide(obs(2, **light), replace(P, max_rate_per_replica=0.5), healthy_long)
    assert d.action == "ScaleDown" and "capacity profile ignored" in d.message


def test_consolidation_removes_down_to_what_the_survivors_can_take_at_most_half():
    healthy_long = replace(WARM, healthy_since=T0 - 1000)
    # 6 replicas at a light load after a crowd: the survivors of a halving are predicted to cope.
    light = obs(6, running=6, tbt_mean_ms=20, tbt_p90_ms=25, ttft_p90_ms=150)
    d = decide(light, P, healthy_long)
    assert (d.action, d.target, d.reason) == ("ScaleDown", 3, "Consolidate")
    assert "with 3 replica(s)" in d.message
    # Busier (batch 40 of 64 each): it stops at the fewest replicas the check accepts, above half.
    busy = obs(6, running=240, tbt_mean_ms=40, tbt_p90_ms=45, ttft_p90_ms=300)
    d = decide(busy, P, healthy_long)
    assert d.action == "ScaleDown" and 3 < d.target < 6
    assert consolidation(busy.stats, P, 6, LatencyModel(), d.target)[0]
    assert not consolidation(busy.stats, P, 6, LatencyModel(), d.target - 1)[0]
