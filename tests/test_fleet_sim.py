"""The fleet simulation end to end and its parts: a short closed loop (two replicas, one scale-up,
one scale-down) that conserves requests and never routes to a replica before it is ready; drains
that finish what they hold or cut it off at the deadline; the HPA recipe's behaviour; the loads."""

from __future__ import annotations

import pytest

from superinfer.engine.slo import SLO
from superinfer.sim.config import SimConfig
from superinfer.sim.fleet.autoscaler import Fixed, HPABehavior, HPAQueue, PodCounts, SLOAutoscaler, slo_spec
from superinfer.sim.fleet.fleet import FleetConfig, job_prompt, run_fleet
from superinfer.sim.fleet.replica import DRAIN_KILLED, Job, Phase, Replica
from superinfer.sim.fleet.report import fleet_report
from superinfer.sim.fleet.router import make_router
from superinfer.sim.fleet.scenarios import Lengths, diurnal, diurnal_rate, flash_crowd, peak_rate
from superinfer.sim.fleet.scrape import VLLM_WAITING
from superinfer.workload.arrivals import WorkItem

SLO_T = SLO(1000.0, 100.0)
SMALL = SimConfig(num_gpu_blocks=40, num_cpu_blocks=200, max_num_seqs=8)  # ~ a few dozen short requests/s
SHORT = Lengths(32, 32, 64, 64)


def fast_spec(max_replicas: int = 2):
    """The operator's autoscaler with its clocks shortened (seconds, not minutes)."""
    fields = {
        "intervalSeconds": 5,
        "initialDelaySeconds": 10,
        "minRequests": 10,
        "scaleUp": {"cooldownSeconds": 10},
        "scaleDown": {"stabilizationSeconds": 30},
    }
    return slo_spec(1, max_replicas, SLO_T.ttft_ms, SLO_T.tbt_ms, SMALL.max_num_seqs, fields, window_seconds=10)


@pytest.fixture(scope="module")
def closed_loop():
    """One replica, a flash crowd (8x for 20 s) that it cannot serve alone, a quiet tail."""
    items = flash_crowd(4, 120, SLO_T, factor=8, start_s=20, length_s=20, lengths=SHORT, seed=1)
    config = FleetConfig(SMALL, initial_replicas=1, ready_delay_s=10, scrape_s=0.1, default_slo=SLO_T)
    scaler = SLOAutoscaler(fast_spec())
    result = run_fleet(config, make_router("epp"), scaler, items)
    return items, result


def test_closed_loop_scales_up_under_a_flash_crowd_and_down_after_stabilizing(closed_loop):
    _, result = closed_loop
    ups = [e for e in result.events if e.to_replicas > e.from_replicas]
    downs = [e for e in result.events if e.to_replicas < e.from_replicas]
    assert [(e.from_replicas, e.to_replicas) for e in ups] == [(1, 2)]
    assert 20 <= ups[0].time <= 45  # during the crowd, once the window shows distress
    assert [(e.from_replicas, e.to_replicas, e.reason) for e in downs] == [(2, 1, "Consolidate")]
    assert downs[0].time >= ups[0].time + 30  # not before the stabilization window
    assert result.replicas_created == 2


def test_fleet_conserves_requests(closed_loop):
    items, result = closed_loop
    assert len(result.timings) == len(items)
    assert sorted(t.arrival for t in result.timings) == sorted(i.arrival_s for i in items)
    assert sum(result.routed.values()) + result.rejected == len(items)
    lengths = sorted(i.output_len for i in items)
    assert sorted(len(t.token_times) for t in result.timings) == lengths  # every request ran to its end
    assert result.killed == 0 and result.rejected == 0


def test_no_request_reaches_a_replica_before_it_is_ready(closed_loop):
    _, result = closed_loop
    report = fleet_report(result, target=0.95, window_s=10.0, timeline_s=10.0)
    assert report["routed"]["r1"] > 0
    assert result.samples[0].ready == 1
    # r1 became ready 10 s after the scale-up: nothing arrived there earlier
    up = next(e for e in result.events if e.to_replicas == 2)
    r1_arrivals = [t.arrival for t in result.timings[report["routed"]["r0"] :]]
    assert min(r1_arrivals) >= up.time + 10 - 1e-9


def test_report_counts_replica_seconds_and_classes(closed_loop):
    _, result = closed_loop
    report = fleet_report(result, target=0.95, window_s=10.0, timeline_s=10.0)
    up = next(e for e in result.events if e.to_replicas == 2)
    down = next(e for e in result.events if e.to_replicas == 1)
    # r0 for the whole run; r1 from its creation to its exit (at most the drain grace after the scale-down)
    r1_least = down.time - up.time
    assert result.end_s + r1_least <= report["replica_seconds"] <= result.end_s + r1_least + 60
    assert set(report["classes"]) == {"default"}
    assert report["scale_ups"] == report["scale_downs"] == 1


def replica(ready_delay: float = 0.0) -> Replica:
    from superinfer.engine.slo_classes import class_table

    return Replica("r", SMALL, SMALL.step_cost(), class_table(None, SLO_T), SLO_T, 0.0, ready_delay)


def send(r: Replica, n: int, output_len: int = 200) -> None:
    for i in range(n):
        r.send(Job(f"w{i}", 0.0, job_prompt(0, i, 32, 128256), output_len, SLO_T, "default", 0))


def test_drain_finishes_in_flight_requests():
    r = replica()
    send(r, 6)
    r.run_until(0.5)
    r.drain(0.5, grace_s=600.0)
    assert r.phase(0.5) is Phase.DRAINING and r.outstanding == 6
    t = 0.5
    while not r.retire_if_idle(t):
        t += 0.5
        r.run_until(t)
    assert r.phase(t) is Phase.GONE
    assert r.killed == set() and len(r.finished) == 6
    assert all(len(tt.token_times) == 200 and tt.error is None for tt in r.timings())


def test_drain_deadline_cuts_off_what_is_left():
    r = replica()
    send(r, 6, output_len=400)
    r.run_until(0.5)
    r.drain(0.5, grace_s=1.0)
    r.run_until(1.5)
    r.kill(1.5)
    assert r.phase(1.5) is Phase.GONE and len(r.killed) == 6
    assert {t.error for t in r.timings()} == {DRAIN_KILLED}
    assert r.seconds_held(100.0) == pytest.approx(1.5)


def test_a_request_larger_than_the_replica_fails_alone():
    r = replica()
    send(r, 2, output_len=4000)
    r.run_until(1.0)
    assert r.outstanding == 0 and all("more KV cache" in (t.error or "") for t in r.timings())


def test_a_replica_drained_before_ready_is_gone_at_once():
    r = replica(ready_delay=60.0)
    assert r.phase(10.0) is Phase.STARTING
    r.drain(10.0, grace_s=60.0)
    assert r.phase(10.0) is Phase.GONE and r.seconds_held(100.0) == 10.0


def page(waiting: float) -> str:
    return f'{VLLM_WAITING}{{model_name="sim"}} {waiting}\n'


def test_hpa_scales_up_at_once_and_down_only_after_300_s():
    hpa = HPAQueue(target_waiting=5.0, min_replicas=1, max_replicas=10)
    up = hpa.tick(0.0, PodCounts(2, 2, 0), {"a": page(20), "b": page(20)})
    assert (up.replicas, up.action) == (6, "ScaleUp")  # 2 x 20/5 = 8, capped at max(+100%, +4 pods) = 6
    pages = {n: page(1) for n in "abcdefgh"}
    holds = [hpa.tick(t, PodCounts(8, 8, 0), pages).replicas for t in range(15, 300, 15)]
    assert set(holds) == {8}  # the 300 s window still holds the first recommendation
    down = hpa.tick(315.0, PodCounts(8, 8, 0), pages)
    assert (down.replicas, down.action) == (2, "ScaleDown")


def test_hpa_does_not_scale_down_at_its_first_tick():
    """The controller seeds its recommendations with the current count: an idle start holds 300 s."""
    hpa = HPAQueue(target_waiting=5.0)
    idle = {n: page(0) for n in "abc"}
    assert hpa.tick(0.0, PodCounts(3, 3, 0), idle).replicas == 3
    assert hpa.tick(285.0, PodCounts(3, 3, 0), idle).replicas == 3
    assert hpa.tick(300.0, PodCounts(3, 3, 0), idle).replicas == 1


def test_hpa_tolerance_and_step_limit_and_pods_without_metrics():
    hpa = HPAQueue(target_waiting=5.0, max_replicas=100, behavior=HPABehavior())
    assert hpa.tick(0.0, PodCounts(4, 4, 0), {n: page(5.4) for n in "abcd"}).action == "Hold"  # within 10%
    assert hpa.tick(15.0, PodCounts(1, 1, 0), {"a": page(100)}).replicas == 5  # +4 pods at most (> 100%)
    # two pods loading count as 0 waiting when scaling up: 3 x (20 / 3) / 5 = 4 replicas
    assert hpa.tick(30.0, PodCounts(3, 1, 2), {"a": page(20)}).replicas == 4


def test_fixed_fleet_never_moves():
    assert Fixed(3).tick(100.0, PodCounts(3, 1, 2), {}).replicas == 3


def test_loads_have_their_shape():
    day = diurnal(2.0, 20.0, 600.0, SLO_T, seed=3)
    assert diurnal_rate(2.0, 20.0, 600.0)(0.0) == pytest.approx(2.0)
    assert diurnal_rate(2.0, 20.0, 600.0)(300.0) == pytest.approx(20.0)
    night = sum(i.arrival_s < 100 for i in day)
    noon = sum(250 <= i.arrival_s < 350 for i in day)
    assert noon > 3 * night
    crowd = flash_crowd(5.0, 400.0, SLO_T, factor=5, start_s=100, length_s=120, seed=2)
    during = sum(100 <= i.arrival_s < 220 for i in crowd) / 120
    before = sum(i.arrival_s < 100 for i in crowd) / 100
    assert 3.5 < during / before < 7
    assert peak_rate(crowd) == pytest.approx(25, rel=0.25)
    assert peak_rate([WorkItem(0.0, 1, 1), WorkItem(10.0, 1, 1)]) == pytest.approx(0.2)


def test_the_pickers_metrics_are_the_queue_and_the_gpu_pool():
    """What docs/kubernetes.md says the stock picker reads: vllm:num_requests_waiting is the waiting
    queue (rotated-out requests not in it), vllm:kv_cache_usage_perc the GPU pool's used share."""
    r = replica()
    send(r, 40, output_len=120)
    r.run_until(2.0)
    view = r.view(2.0)
    assert view.vllm_waiting == r.sched.num_waiting == view.waiting
    assert view.rotary == r.sched.num_rotary > 0  # streams rotated out, not counted as waiting
    assert view.vllm_kv_usage == pytest.approx(r.sched.kv.usage) == pytest.approx(view.kv_gpu)
    assert view.vllm_running == r.sched.num_running and view.gpu_blocks == SMALL.num_gpu_blocks


def test_autoscaler_stacks_scale_ups_during_a_crowd_and_none_after_it():
    """Issue 48's findings in decide(), as a scenario: a crowd (16x for 60 s) longer than a replica's
    start (30 s). Pods still starting count as capacity on the way, so scale-ups stack while they
    start and the fleet is at its maximum before the crowd ends (before: one doubling per start);
    once it has passed, the backlog left on the first pods and the window still counting the crowd
    order nothing more (before: 4 -> 6 ten seconds after it ended); and the fleet then shrinks by
    more than one replica at a time."""
    end = 80.0
    items = flash_crowd(4, 130, SLO_T, factor=16, start_s=20, length_s=end - 20, lengths=SHORT, seed=1)
    config = FleetConfig(SMALL, initial_replicas=1, ready_delay_s=30, scrape_s=0.1, default_slo=SLO_T)
    result = run_fleet(config, make_router("epp"), SLOAutoscaler(fast_spec(max_replicas=6)), items)
    ups = [e for e in result.events if e.to_replicas > e.from_replicas]
    downs = [e for e in result.events if e.to_replicas < e.from_replicas]
    assert any("still starting" in e.message for e in ups)  # stacked on pods not ready yet
    assert ups[-1].to_replicas == 6 and ups[-1].time < end
    assert downs and downs[0].from_replicas - downs[0].to_replicas > 1
    assert all(e.time < end for e in ups)
