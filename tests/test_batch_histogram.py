"""The batched histograms (time between tokens, vLLM's inter-token latency, the step phases and
KV copies) expose exactly what prometheus-client's Histogram would for the same observations, and
one call per step counts a step's tokens."""

from __future__ import annotations

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from superinfer.engine import contract as c
from superinfer.engine.core.request import Request, SamplingParams
from superinfer.engine.core.token_timing import TokenTiming
from superinfer.engine.metrics import FEW_VALUES, BatchHistogram, EngineMetrics
from superinfer.engine.slo import SLO

BUCKETS = (0.01, 0.1, 0.5, 1.0)
# On a bound (le is inclusive), between bounds, below the first and past the last.
VALUES = {("m", "interactive"): [0.1, 0.05, 0.0, 3.0, 0.1], ("m", "batch"): [1.0, 0.7]}


def samples(registry: CollectorRegistry) -> list[tuple[str, dict[str, str], float]]:
    text = generate_latest(registry).decode()
    out = [
        (s.name, s.labels, s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if not s.name.endswith("_created")
    ]
    return sorted(out, key=lambda s: (s[0], sorted(s[1].items())))


@pytest.mark.parametrize("mode", ["one-by-one", "few-at-once", "many-at-once"])
def test_exposes_what_prometheus_clients_histogram_exposes(mode):
    """One value a call, a step's few (a Python loop) and a step's many (numpy's pass)."""
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    batch_histogram = BatchHistogram("gap_seconds", "gap", ["model_name", "slo_class"], BUCKETS, ours)
    histogram = Histogram("gap_seconds", "gap", ["model_name", "slo_class"], buckets=BUCKETS, registry=theirs)
    repeat = 20 if mode == "many-at-once" else 1
    for labels, values in VALUES.items():
        values = values * repeat
        if mode == "few-at-once":
            batch_histogram.observe_all(labels, values)
        elif mode == "many-at-once":
            assert len(values) > FEW_VALUES
            batch_histogram.observe_all(labels, np.array(values))
        for v in values:
            if mode == "one-by-one":
                batch_histogram.observe_all(labels, [v])
            histogram.labels(*labels).observe(v)
    mine, reference = samples(ours), samples(theirs)
    assert [s[:2] for s in mine] == [s[:2] for s in reference]
    assert [s[2] for s in mine] == pytest.approx([s[2] for s in reference])  # (numpy sums pairwise)
    got = {(s[1]["slo_class"], s[1].get("le")): s[2] for s in mine if s[0] == "gap_seconds_bucket"}
    assert got["interactive", "0.1"] == 4 * repeat and got["interactive", "0.01"] == repeat
    assert got["interactive", "+Inf"] == 5 * repeat


def test_one_call_per_step_counts_first_tokens_and_gaps_per_class():
    metrics = EngineMetrics("m", SLO(), {}, vllm_compat=True, classes={"interactive": SLO(), "batch": SLO()})
    first = Request("a", [1, 2], SamplingParams(), arrival_time=0.0, slo_class="interactive")
    first.t_scheduled, first.t_first_token = 0.1, 0.3
    timing = TokenTiming()  # an update: "a"'s first token, and a token of a "batch" request 0.25 s after its last
    timing.first.append(first)
    timing.add_gaps("batch", np.array([0.25]))
    metrics.on_tokens(2, timing)

    def value(name: str, **labels: str) -> float | None:
        return metrics.registry.get_sample_value(name, {"model_name": "m", **labels})

    assert value(c.metric("generation_tokens_total")) == 2
    assert value(c.metric("time_to_first_token_seconds_sum"), slo_class="interactive") == pytest.approx(0.3)
    assert value(c.metric("time_between_tokens_seconds_count"), slo_class="batch") == 1
    assert value(c.metric("time_between_tokens_seconds_sum"), slo_class="batch") == pytest.approx(0.25)
    assert value(c.metric("time_between_tokens_seconds_count"), slo_class="interactive") is None
    assert value("vllm:inter_token_latency_seconds_sum") == pytest.approx(0.25)
    assert value("vllm:generation_tokens_total") == 2
