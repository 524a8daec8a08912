"""Fleet routers and what they scrape: each picks what its signals say, the picker's signals are
what the engine's /metrics says, and a rotary engine's backlog off the GPU is invisible to the
stock picker's metrics."""

from __future__ import annotations

import pytest

from superinfer.engine.metrics import EngineMetrics
from superinfer.engine.slo import SLO
from superinfer.sim.fleet.router import (
    Endpoint,
    LeastOutstanding,
    PrefixIndex,
    RoundRobin,
    kv_demand,
    make_router,
    min_max_low,
)
from superinfer.sim.fleet.scrape import PodView, parse_view, render_gauges


def ep(name: str, outstanding: int = 0, **view) -> Endpoint:
    return Endpoint(name, PodView(name, 0.0, **view), outstanding)


def test_round_robin_takes_turns():
    router, endpoints = RoundRobin(), [ep("a"), ep("b"), ep("c")]
    assert [router.pick([], endpoints) for _ in range(6)] == ["a", "b", "c", "a", "b", "c"]


def test_least_outstanding_picks_the_least_loaded():
    router = LeastOutstanding()
    endpoints = [ep("a", 7), ep("b", 2), ep("c", 5)]
    assert {router.pick([], endpoints) for _ in range(5)} == {"b"}


def test_queue_signal_is_min_max_normalised_and_neutral_when_equal():
    assert min_max_low({"a": 10, "b": 0, "c": 5}) == {"a": 0.0, "b": 1.0, "c": 0.5}
    assert min_max_low({"a": 3, "b": 3}) == {"a": 1.0, "b": 1.0}


def test_endpoint_picker_prefers_short_queue_then_free_kv():
    epp = make_router("epp")
    queues = [ep("a", vllm_waiting=9, vllm_kv_usage=0.5), ep("b", vllm_waiting=1, vllm_kv_usage=0.5)]
    assert epp.pick([], queues) == "b"
    kv = [ep("a", vllm_waiting=2, vllm_kv_usage=0.9), ep("b", vllm_waiting=2, vllm_kv_usage=0.2)]
    assert epp.pick([], kv) == "b"


def test_prefix_affinity_outweighs_a_small_load_difference():
    """Weight 3 for a full prefix match against 2 + 2 for load: the warm pod keeps the prefix."""
    epp = make_router("epp")
    prompt = list(range(16, 16 + 256))
    even = [ep("a", vllm_waiting=0, vllm_kv_usage=0.1), ep("b", vllm_waiting=0, vllm_kv_usage=0.1)]
    first = epp.pick(prompt, even)
    other = "b" if first == "a" else "a"
    busier = [ep(first, vllm_waiting=4, vllm_kv_usage=0.3), ep(other, vllm_waiting=0, vllm_kv_usage=0.1)]
    assert epp.pick(prompt, busier) == first
    assert epp.pick(list(range(1000, 1256)), busier) == other  # no shared prefix: load decides


def test_prefix_index_matches_leading_blocks_only():
    index = PrefixIndex()
    prompt = list(range(200))  # 3 full blocks of 64
    index.record(PrefixIndex.block_hashes(prompt), "a")
    assert index.score(PrefixIndex.block_hashes(prompt), "a") == 1.0
    changed = [*prompt[:64], 999999, *prompt[65:]]  # the second block differs: only the first matches
    assert index.score(PrefixIndex.block_hashes(changed), "a") == pytest.approx(1 / 3)
    assert index.score(PrefixIndex.block_hashes(prompt), "b") == 0.0


def test_stock_picker_cannot_see_rotated_out_backlog_and_rotary_signals_can():
    """Under rotary a pod may admit new requests (none waiting) while 60 streams sit rotated out:
    the stock picker's metrics make it look idle; waiting-with-rotated-out and KV demand do not."""
    hidden = dict(vllm_waiting=0, vllm_kv_usage=0.99, waiting=0, rotary=60, running=40, kv_gpu=0.99)
    honest = dict(vllm_waiting=3, vllm_kv_usage=0.99, waiting=3, rotary=0, running=40, kv_gpu=0.99)
    endpoints = [ep("hidden", **hidden), ep("honest", **honest)]
    assert make_router("epp").pick([], endpoints) == "hidden"
    assert make_router("epp-rotary").pick([], endpoints) == "honest"
    assert make_router("slo").pick([], endpoints) == "honest"
    assert kv_demand(endpoints[0].view) == 1.0 and kv_demand(PodView("x", 0, running=10, kv_gpu=0.4)) == 0.4


def test_slo_scorer_avoids_the_pod_furthest_behind_its_slo():
    endpoints = [ep("late", waiting=2, slo_lag_s=3.0, running=20), ep("fine", waiting=2, slo_lag_s=0.0, running=20)]
    assert make_router("slo").pick([], endpoints) == "fine"


def test_scraped_view_is_what_the_engine_metrics_say():
    """The picker's inputs come from the engine's own gauges, through the text format."""
    m = EngineMetrics("sim", SLO(), {}, vllm_compat=True)
    m.vllm["waiting"].labels("sim").set(4)
    m.vllm["running"].labels("sim").set(12)
    m.vllm["kv"].labels("sim").set(0.75)
    m.gauges["requests_rotary"].labels("sim").set(9)
    m.gauges["slo_lag_seconds"].labels("sim").set(1.5)
    m.gauges["kv_cache_usage_ratio"].labels("sim", "gpu").set(0.75)
    m.gauges["kv_cache_usage_ratio"].labels("sim", "cpu").set(0.25)
    view = parse_view("p", render_gauges(m), 3.0)
    assert (view.vllm_waiting, view.vllm_running, view.vllm_kv_usage) == (4, 12, 0.75)
    assert (view.rotary, view.slo_lag_s, view.kv_gpu, view.kv_cpu) == (9, 1.5, 0.75, 0.25)
    assert render_gauges(m).splitlines()[0] in m.render().decode()  # the same lines as /metrics


def test_unknown_router_is_refused():
    with pytest.raises(ValueError, match="unknown router"):
        make_router("random")
