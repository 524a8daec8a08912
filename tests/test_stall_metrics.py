"""Stalls end to end on the engine's side: the stall budget as a class field, a server flag, a
request's body field and header, and the worst-gap histogram and stalled-request counter in /metrics."""

from __future__ import annotations

import json
import re
import sys

import aiohttp
import pytest
from pydantic import ValidationError

from superinfer.cli.main import build_parser, main
from superinfer.engine import contract as c
from superinfer.engine.config import EngineConfig
from superinfer.engine.core.request import FinishReason, Request, SamplingParams
from superinfer.engine.flags import engine_config
from superinfer.engine.metrics import LATENCY_BUCKETS, EngineMetrics
from superinfer.engine.serving.server import RunningServer, start_server
from superinfer.engine.slo import SLO
from superinfer.engine.slo_classes import SLOClass, parse_classes, resolve

# ---- the metrics, on hand-made requests -----------------------------------------------------------

CLASSES = {"chat": SLO(500, 100, stall_ms=350), "default": SLO(5000, 100)}  # default: 5 x 100 ms = 0.5 s


def finished(slo_class: str, gaps: list[float], arrival: float = 0.0) -> Request:
    """A request that got one token after 0.1 s, then one after each gap, and stopped."""
    req = Request("r", [1, 2, 3], SamplingParams(max_tokens=16), arrival, slo=CLASSES[slo_class], slo_class=slo_class)
    req.t_first_token = arrival + 0.1
    req.token_ids = [1, 2, 3, *range(10, 11 + len(gaps))]
    req.token_gaps.extend(gaps)
    req.max_gap_s = max(gaps, default=0.0)
    req.finish_reason = FinishReason.STOP
    return req


def value(m: EngineMetrics, name: str, **labels: str) -> float | None:
    return m.registry.get_sample_value(c.metric(name), {"model_name": "m", **labels})


def worst_gap_bounds(m: EngineMetrics) -> set[float]:
    name = c.metric("worst_gap_seconds_bucket")
    return {float(s.labels["le"]) for fam in m.registry.collect() for s in fam.samples if s.name == name}


def test_worst_gap_buckets_include_every_class_stall_budget():
    m = EngineMetrics("m", SLO(), {}, classes=CLASSES)
    m.on_finish(finished("chat", [0.01]), 1.0)
    assert 0.35 not in LATENCY_BUCKETS
    assert {0.35, 0.5, *LATENCY_BUCKETS} <= worst_gap_bounds(m)
    assert value(m, "slo_target_seconds", kind="stall", slo_class="chat") == 0.35
    assert value(m, "slo_target_seconds", kind="stall", slo_class="default") == 0.5
    for cls in CLASSES:  # exported from the start, so a rate over the first window is defined
        assert value(m, "stalled_requests_total", slo_class=cls) == 0.0


def test_worst_gap_and_stalls_are_counted_once_per_finished_stream():
    m = EngineMetrics("m", SLO(), {}, classes=CLASSES)
    steady = [0.05] * 199  # p99 gap 50 ms with one more gap of any length
    m.on_finish(finished("chat", [*steady, 0.3]), 1.0)  # within chat's 0.35 s budget
    m.on_finish(finished("chat", [*steady, 0.4]), 1.0)  # one 0.4 s stall
    m.on_finish(finished("default", [0.05, 0.4]), 1.0)  # 0.4 s is within default's 0.5 s
    m.on_finish(finished("default", []), 1.0)  # one token: no gap, not a stream
    assert value(m, "worst_gap_seconds_count", slo_class="chat") == 2
    assert value(m, "worst_gap_seconds_sum", slo_class="chat") == pytest.approx(0.7)
    assert value(m, "worst_gap_seconds_bucket", slo_class="chat", le="0.35") == 1
    assert value(m, "worst_gap_seconds_bucket", slo_class="chat", le="+Inf") == 2
    assert value(m, "worst_gap_seconds_count", slo_class="default") == 1
    assert value(m, "stalled_requests_total", slo_class="chat") == 1
    assert value(m, "stalled_requests_total", slo_class="default") == 0
    # The stalled stream misses its TBT SLO though its p99 gap is within the target; the other meets it.
    verdicts = {"model_name": "m", "slo_class": "chat", "ttft": "met"}
    assert m.registry.get_sample_value(c.metric("slo_requests_total"), {**verdicts, "tbt": "missed"}) == 1
    assert m.registry.get_sample_value(c.metric("slo_requests_total"), {**verdicts, "tbt": "met"}) == 1


def test_a_request_aborted_before_its_first_token_has_no_worst_gap():
    m = EngineMetrics("m", SLO(), {}, classes=CLASSES)
    req = Request("r", [1], SamplingParams(), 0.0, slo=CLASSES["chat"], slo_class="chat")
    req.finish_reason = FinishReason.ABORT
    m.on_finish(req, 1.0)
    assert value(m, "worst_gap_seconds_count", slo_class="chat") is None
    assert c.metric("worst_gap_seconds_bucket") in c.exported_series_names()
    assert c.metric("stalled_requests_total") in c.exported_series_names()


# ---- the class field, the flag ----------------------------------------------------------------------


def test_a_class_carries_its_stall_budget():
    classes = parse_classes('{"chat": {"ttft_ms": 500, "tbt_ms": 100, "stall_ms": 2000}}')
    assert classes["chat"].slo == SLO(500, 100, 2000)
    assert classes["chat"].slo.stall_budget_ms == 2000
    assert SLOClass(ttft_ms=500, tbt_ms=100).slo.stall_budget_ms == c.DEFAULT_STALL_FACTOR * 100


@pytest.mark.parametrize(
    ("stall", "message"),
    [
        (50, "chat: stall_ms (50) must be at least tbt_ms (100)"),
        (0, "chat.stall_ms: Input should be greater than 0"),
        (2e12, "chat.stall_ms: Input should be less than or equal to 1000000000000"),
        ("soon", "chat.stall_ms: Input should be a valid number"),
    ],
)
def test_bad_class_stall_budgets_are_refused_clearly(stall, message):
    with pytest.raises(ValidationError, match="slo_classes") as err:
        EngineConfig(slo_classes={"chat": {"ttft_ms": 500, "tbt_ms": 100, "stall_ms": stall}})
    assert message in str(err.value)


def test_resolve_overrides_the_stall_budget_field_by_field():
    cls = SLOClass(ttft_ms=500, tbt_ms=100, stall_ms=400)
    assert resolve(cls)[0] == SLO(500, 100, 400)
    assert resolve(cls, stall_ms=900)[0] == SLO(500, 100, 900)
    assert resolve(cls, tbt_ms=200)[0] == SLO(500, 200, 400)
    assert resolve(cls, tbt_ms=800)[0] == SLO(500, 800, 800)  # the class's budget, raised to the looser TBT
    assert resolve(SLOClass(ttft_ms=500, tbt_ms=100), tbt_ms=300)[0].stall_budget_ms == 1500
    with pytest.raises(ValueError, match=re.escape("stall_ms (50) must be at least the request's tbt_ms (100)")):
        resolve(cls, stall_ms=50)


def test_the_stall_flag_sets_the_default_class_budget():
    args = build_parser().parse_args(["serve", "--tbt-slo-ms", "50", "--stall-slo-ms", "750"])
    config = engine_config(args)
    assert config.stall_slo_ms == 750 and config.default_slo == SLO(5000, 50, 750)
    assert config.slo_class_table()[c.DEFAULT_SLO_CLASS].slo == SLO(5000, 50, 750)
    assert EngineConfig().default_slo.stall_budget_ms == c.DEFAULT_STALL_FACTOR * c.DEFAULT_TBT_SLO_MS
    assert "--stall-slo-ms" in c.SERVE_FLAGS


def test_serve_refuses_a_stall_budget_below_the_tbt_target(capsys):
    with pytest.raises(SystemExit) as exit_info:
        sys.exit(main(["serve", "--device", "cpu", "--tbt-slo-ms", "100", "--stall-slo-ms", "20"]))
    assert exit_info.value.code == 2
    assert "stall_slo_ms (20) must be at least tbt_slo_ms (100)" in capsys.readouterr().err


# ---- over HTTP: the body field and the header ---------------------------------------------------------

MODEL = "tiny-stalls"


@pytest.fixture
async def server():
    running = await start_server(
        EngineConfig(
            engine_process=False,  # the tests read the engine core's state
            model="tiny",
            served_model_name=MODEL,
            device="cpu",
            port=0,
            max_model_len=128,
            num_gpu_blocks=32,
            ttft_slo_ms=1e9,
            tbt_slo_ms=1e9,
            stall_slo_ms=1e10,
            slo_classes=json.dumps({"chat": {"ttft_ms": 1e9, "tbt_ms": 100, "stall_ms": 1e9}}),
        )
    )
    yield running
    await running.close()


@pytest.fixture
def admitted(server: RunningServer) -> list[Request]:
    scheduler = server.server.core.scheduler
    seen: list[Request] = []
    real_add = scheduler.add

    def add(req: Request) -> None:
        seen.append(req)
        real_add(req)

    scheduler.add = add
    return seen


async def post(server: RunningServer, body: dict, headers: dict | None = None) -> tuple[int, dict]:
    payload = {"model": MODEL, "prompt": "x", "max_tokens": 4, "ignore_eos": True, **body}
    async with (
        aiohttp.ClientSession() as http,
        http.post(server.url + c.COMPLETIONS_PATH, json=payload, headers=headers) as resp,
    ):
        return resp.status, await resp.json()


@pytest.mark.parametrize(
    ("body", "headers", "stall"),
    [
        ({}, {}, 1e10),  # the server's --stall-slo-ms
        ({"slo_class": "chat"}, {}, 1e9),  # the class's
        ({"slo_class": "chat", "slo": {"stall_ms": 250}}, {}, 250),
        ({"slo_class": "chat"}, {c.SLO_STALL_HEADER: "300"}, 300),
        ({"slo_class": "chat", "slo": {"stall_ms": 250}}, {c.SLO_STALL_HEADER: "300"}, 250),  # the body wins
        ({"slo": {"tbt_ms": 20}}, {}, 1e10),
    ],
)
async def test_a_request_carries_its_stall_budget_to_the_scheduler(server, admitted, body, headers, stall):
    status, payload = await post(server, body, headers)
    assert status == 200, payload
    (req,) = admitted
    assert req.slo.stall_budget_ms == stall


@pytest.mark.parametrize(
    ("body", "headers", "message", "param"),
    [
        ({}, {c.SLO_STALL_HEADER: "soon"}, "header x-slo-stall-ms must be a number of milliseconds", None),
        ({}, {c.SLO_STALL_HEADER: "0"}, "header x-slo-stall-ms must be a number of milliseconds", None),
        ({}, {c.SLO_STALL_HEADER: "nan"}, "header x-slo-stall-ms must be a number of milliseconds", None),
        ({"slo": {"stall_ms": -1}}, {}, "greater than 0", "slo.stall_ms"),
        ({"slo_class": "chat", "slo": {"stall_ms": 50}}, {}, "stall_ms (50) must be at least", "slo.stall_ms"),
        ({"slo_class": "chat"}, {c.SLO_STALL_HEADER: "50"}, "(from header x-slo-stall-ms)", None),
    ],
)
async def test_bad_stall_budgets_are_a_400(server, admitted, body, headers, message, param):
    status, payload = await post(server, body, headers)
    assert status == 400, payload
    assert message in payload["error"]["message"]
    assert payload["error"]["param"] == param
    assert admitted == []


async def test_a_finished_stream_is_in_the_worst_gap_histogram(server):
    assert (await post(server, {"slo_class": "chat"}))[0] == 200
    async with aiohttp.ClientSession() as http, http.get(server.url + c.METRICS_PATH) as resp:
        text = await resp.text()
    assert c.metric("worst_gap_seconds_bucket") in text and c.metric("stalled_requests_total") in text
    reg = server.server.core.metrics.registry
    labels = {"model_name": MODEL, "slo_class": "chat"}
    assert reg.get_sample_value(c.metric("worst_gap_seconds_count"), labels) == 1.0  # 4 tokens, one stream
    assert reg.get_sample_value(c.metric("stalled_requests_total"), labels) == 0.0
