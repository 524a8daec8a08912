"""The autoscaler's Prometheus source, against a small Prometheus HTTP API stand-in."""

from __future__ import annotations

import re

import aiohttp
from aiohttp import web

from superinfer.engine import contract
from superinfer.operator.api.inference_service import InferenceServiceSpec
from superinfer.operator.autoscaling import pod_metrics, prometheus_window
from superinfer.operator.autoscaling.decision import Memory, Observation, Params, decide


def vector(value: float, **labels: str) -> dict:
    return {"metric": labels, "value": [0, str(value)]}


# Requests without a class and `batch` ones: batch is slow (12 s to the first token) but within its 30 s.
ANSWERS = {
    "sum by (slo_class, ttft, tbt) (increase(": [
        vector(50, ttft="met", tbt="met", slo_class="default"),
        vector(40, ttft="missed", tbt="met", slo_class="default"),
        vector(10, ttft="met", tbt="met", slo_class="batch"),
    ],
    "histogram_quantile(0.9, sum by (le) (rate(superinfer_engine_time_to_first": [vector(2.5)],
    "histogram_quantile(0.9, sum by (le) (rate(superinfer_engine_time_between": [vector(0.04)],
    "histogram_quantile(0.9, sum by (slo_class, le) (rate(superinfer_engine_time_to_first": [
        vector(2.4, slo_class="default"),
        vector(12, slo_class="batch"),
    ],
    "histogram_quantile(0.9, sum by (slo_class, le) (rate(superinfer_engine_time_between": [
        vector(0.04, slo_class="default"),
        vector("NaN", slo_class="batch"),  # single-token answers: no gaps
    ],
    "min by (slo_class, kind) (superinfer_engine_slo_target_seconds": [
        vector(5, kind="ttft", slo_class="default"),
        vector(0.1, kind="tbt", slo_class="default"),
        vector(30, kind="ttft", slo_class="batch"),
        vector(1, kind="tbt", slo_class="batch"),
    ],
    "sum by (slo_class) (increase(superinfer_engine_stalled_requests_total": [
        vector(1, slo_class="default"),  # 1 of 90: over the share, but attainment drives the step
        vector(0, slo_class="batch"),
    ],
    "sum(rate(superinfer_engine_time_between_tokens_seconds_sum": [vector("NaN")],
    "count(": [vector(2)],
    "sum(superinfer_engine_requests_running": [vector(30)],
    "sum(superinfer_engine_requests_waiting": [vector(12)],
    "sum(superinfer_engine_requests_rotary": [],
    "avg by (tier)": [vector(0.9, tier="gpu"), vector(0.2, tier="cpu")],
    "sum(rate(superinfer_engine_kv_swap": [vector(3e9)],
}


QUERIES = web.AppKey("queries", list)
AUTH = web.AppKey("auth", str)
TOKEN = "prom-token"
ANSWERED = web.AppKey("answers", dict)


async def fake_prometheus(request: web.Request) -> web.Response:
    query = request.query["query"]
    assert 'namespace="prod", inferenceservice="llama"' in query  # the service, not a model name others share
    assert request.headers.get("Authorization") == request.app[AUTH]
    assert "[120s]" in query or "[" not in query
    request.app[QUERIES].append(query)
    result = next((v for k, v in request.app[ANSWERED].items() if query.startswith(k)), None)
    if result is None:
        return web.json_response({"status": "error", "error": f"unexpected query {query}"}, status=400)
    return web.json_response({"status": "success", "data": {"resultType": "vector", "result": result}})


def source(url: str) -> prometheus_window.PrometheusSource:
    return prometheus_window.PrometheusSource(url=url, bearer_token=TOKEN)


async def serve(answers: dict = ANSWERS) -> tuple[web.AppRunner, str, list[str]]:
    app = web.Application()
    app[QUERIES] = []
    app[ANSWERED] = answers
    app[AUTH] = f"Bearer {TOKEN}"
    app.router.add_get("/api/v1/query", fake_prometheus)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}", app[QUERIES]


async def test_window_from_prometheus_feeds_decide():
    runner, url, queries = await serve()
    try:
        async with aiohttp.ClientSession() as session:
            stats = await prometheus_window.window(session, source(url), "prod", "llama", 120, timeout=5)
    finally:
        await runner.cleanup()
    assert len(queries) == len(prometheus_window.queries("prod", "llama", 120))
    assert stats is not None and stats.pods == 2 and stats.requests == 100
    assert stats.attainment == 0.6 and stats.ttft_p90_ms == 2500 and stats.tbt_p90_ms == 40
    assert stats.tbt_mean_ms is None  # NaN from 0/0 is "no data"
    assert (stats.kv_gpu, stats.kv_cpu, stats.swap_gbps, stats.rotary) == (0.9, 0.2, 3.0, 0.0)
    assert stats.ttft_p90_ms == 2500  # pooled, for the status
    assert set(stats.classes) == {"default", "batch"}
    batch = stats.classes["batch"]
    assert (batch.requests, batch.attainment, batch.ttft_p90_ms, batch.tbt_p90_ms) == (10, 1.0, 12000, None)
    assert (batch.ttft_target_ms, batch.tbt_target_ms) == (30000, 1000)
    assert stats.classes["default"].attainment == 50 / 90
    assert (stats.classes["default"].stalled, batch.stalled) == (1, 0)
    spec = InferenceServiceSpec.model_validate({"model": {"uri": "preset://tiny"}, "autoscaling": {"enabled": True}})
    decision = decide(Observation(1000, 2, 2, 0, 0, stats), Params.from_spec(spec), Memory(started_at=0))
    assert decision.action == "ScaleUp" and decision.target == 4
    assert "TTFT" not in decision.message  # batch's 12 s is within its 30 s; attainment drove it


async def test_a_source_without_class_labels_or_targets_is_one_default_class():
    """An engine from before SLO classes: no slo_class label, no target gauge; the spec's SLO applies."""
    strip = {"slo_class"}
    answers = {
        k: [{**r, "metric": {n: v for n, v in r["metric"].items() if n not in strip}} for r in rows]
        for k, rows in ANSWERS.items()
        if not k.startswith("min by")
    }
    answers["sum by (slo_class, ttft, tbt) (increase("] = [
        vector(95, ttft="met", tbt="met"),
        vector(5, ttft="met", tbt="missed"),
    ]
    answers["histogram_quantile(0.9, sum by (slo_class, le) (rate(superinfer_engine_time_to_first"] = [vector(1.5)]
    answers["histogram_quantile(0.9, sum by (slo_class, le) (rate(superinfer_engine_time_between"] = [vector(0.04)]
    answers["min by (slo_class, kind) (superinfer_engine_slo_target_seconds"] = []
    runner, url, _ = await serve(answers)
    try:
        async with aiohttp.ClientSession() as session:
            stats = await prometheus_window.window(session, source(url), "prod", "llama", 120, timeout=5)
    finally:
        await runner.cleanup()
    assert stats is not None and list(stats.classes) == ["default"]
    only = stats.classes["default"]
    assert (only.requests, only.ttft_p90_ms, only.ttft_target_ms) == (100, 1500, None)
    spec = InferenceServiceSpec.model_validate(
        {"model": {"uri": "preset://tiny"}, "slo": {"ttftMs": 1000}, "autoscaling": {"enabled": True}}
    )
    decision = decide(Observation(1000, 2, 2, 0, 0, stats), Params.from_spec(spec), Memory(started_at=0))
    assert decision.action == "ScaleUp" and decision.target == 3
    assert decision.message.startswith("p90 TTFT 1500ms > 1000ms (class default)")


async def test_unreachable_prometheus_means_no_window():
    async with aiohttp.ClientSession() as session:
        assert (
            await prometheus_window.window(session, source("http://127.0.0.1:9"), "prod", "llama", 120, timeout=1)
            is None
        )
    assert prometheus_window.build_stats({"pods": []}, 120) is None


def test_queries_and_scrape_read_only_series_and_labels_of_the_engine_contract():
    known = contract.exported_series_names()
    families = (*contract.COUNTERS.values(), *contract.HISTOGRAMS.values(), *contract.GAUGES.values())
    labels = {label for family in families for label in family} | set(contract.SLO_TARGET_LABELS) | {"le"}
    for expr in prometheus_window.queries("prod", "llama", 120).values():
        names = set(re.findall(r"\b(superinfer_engine_[a-z_]+)\{", expr))
        assert names and names <= known, expr
        for group in re.findall(r"\bby \(([^)]*)\)", expr):
            assert {g.strip() for g in group.split(",")} <= labels, expr
    assert set(pod_metrics.USED_SERIES) <= known
