"""Named SLO classes end to end: --slo-classes validation, picking a class over HTTP (body field or
header), the override rules, unknown classes, and the metrics labelled by class."""

from __future__ import annotations

import json
import sys

import aiohttp
import pytest
from pydantic import ValidationError

from superinfer.cli.main import main
from superinfer.engine import contract as c
from superinfer.engine.config import EngineConfig
from superinfer.engine.core.request import Request
from superinfer.engine.engine import EngineCore
from superinfer.engine.serving.server import RunningServer, start_server
from superinfer.engine.slo import SLO
from superinfer.engine.slo_classes import SLOClass
from superinfer.workload.arrivals import WorkItem
from superinfer.workload.replay import replay

MODEL = "tiny-classes"
# Targets no machine can miss (loose) or meet (strict), so each class's verdict is known in advance.
LOOSE, STRICT = 1e9, 1e-6
CLASSES = {
    "loose": {"ttft_ms": LOOSE, "tbt_ms": LOOSE, "priority": 3},
    "strict": {"ttft_ms": STRICT, "tbt_ms": LOOSE},
}


# ---- configuration ------------------------------------------------------------------------------


def test_builtin_classes_and_the_default_class():
    table = EngineConfig(ttft_slo_ms=2000, tbt_slo_ms=50).slo_class_table()
    assert table == {
        "interactive": SLOClass(ttft_ms=500, tbt_ms=100, priority=1),
        "batch": SLOClass(ttft_ms=30000, tbt_ms=1000, priority=0),
        "default": SLOClass(ttft_ms=2000, tbt_ms=50, priority=0),
    }


def test_given_classes_replace_the_builtin_ones():
    table = EngineConfig(slo_classes=json.dumps(CLASSES)).slo_class_table()
    assert set(table) == {"loose", "strict", "default"}
    assert table["loose"].priority == 3 and table["strict"].priority == 0
    assert set(EngineConfig(slo_classes="{}").slo_class_table()) == {"default"}
    assert EngineConfig(slo_classes=CLASSES) == EngineConfig(slo_classes=json.dumps(CLASSES))  # a dict works too


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ('{"Interactive": {"ttft_ms": 1, "tbt_ms": 1}}', "'Interactive' is not a class name"),
        ('{"2fast": {"ttft_ms": 1, "tbt_ms": 1}}', "'2fast' is not a class name"),
        ('{"default": {"ttft_ms": 1, "tbt_ms": 1}}', "'default' is reserved"),
        ('{"fast": {"ttft_ms": 0, "tbt_ms": 1}}', "fast.ttft_ms: Input should be greater than 0"),
        ('{"fast": {"ttft_ms": 1}}', "fast.tbt_ms: Field required"),
        ('{"fast": {"ttft_ms": 1, "tbt_ms": 1, "prio": 2}}', "fast.prio: Extra inputs are not permitted"),
        ('{"fast": {"ttft_ms": 1, "tbt_ms": 1, "priority": 1.5}}', "fast.priority"),
        ("{fast}", "must be a JSON object"),
        ('["fast"]', "invalid SLO classes"),
    ],
)
def test_bad_slo_classes_are_rejected_with_a_clear_message(value, message):
    with pytest.raises(ValidationError, match="slo_classes") as err:
        EngineConfig(slo_classes=value)
    assert message in str(err.value)


def test_serve_refuses_bad_classes_at_startup(capsys):
    with pytest.raises(SystemExit) as exit_info:
        sys.exit(main(["serve", "--device", "cpu", "--slo-classes", '{"default": {"ttft_ms": 1, "tbt_ms": 1}}']))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "invalid configuration" in err and "'default' is reserved" in err


# ---- over HTTP ----------------------------------------------------------------------------------


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
            ttft_slo_ms=LOOSE,
            tbt_slo_ms=LOOSE,
            slo_classes=json.dumps(CLASSES),
        )
    )
    yield running
    await running.close()


@pytest.fixture
def admitted(server: RunningServer) -> list[Request]:
    """Every Request the scheduler is given, as the engine built it."""
    scheduler = server.server.core.scheduler
    seen: list[Request] = []
    real_add = scheduler.add

    def add(req: Request) -> None:
        seen.append(req)
        real_add(req)

    scheduler.add = add
    return seen


async def post_to(server: RunningServer, model: str, body: dict, headers: dict | None = None, chat: bool = False):
    """(status, JSON body or the raw event stream)."""
    path = c.CHAT_COMPLETIONS_PATH if chat else c.COMPLETIONS_PATH
    async with (
        aiohttp.ClientSession() as http,
        http.post(server.url + path, json={"model": model, **body}, headers=headers) as resp,
    ):
        text = await resp.text()
        return resp.status, text if text.startswith("data:") else json.loads(text)


async def post(server: RunningServer, body: dict, headers: dict | None = None, chat: bool = False):
    prompt = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "x"}
    return await post_to(server, MODEL, {**prompt, "max_tokens": 3, **body}, headers, chat)


async def test_a_request_gets_its_class_targets_and_priority(server, admitted):
    assert (await post(server, {"slo_class": "loose"}))[0] == 200
    assert (await post(server, {}, {c.SLO_CLASS_HEADER: "strict"}, chat=True))[0] == 200
    assert (await post(server, {}))[0] == 200
    got = [(r.slo_class, r.slo, r.priority) for r in admitted]
    assert got == [
        ("loose", SLO(LOOSE, LOOSE), 3),
        ("strict", SLO(STRICT, LOOSE), 0),
        (c.DEFAULT_SLO_CLASS, SLO(LOOSE, LOOSE), 0),
    ]


@pytest.mark.parametrize(
    ("body", "headers", "expected"),
    [
        # Body targets replace the class's field by field; the other field stays the class's.
        ({"slo_class": "strict", "slo": {"ttft_ms": 700}}, {}, ("strict", SLO(700, LOOSE), 0)),
        ({"slo_class": "loose", "slo": {"tbt_ms": 40}}, {}, ("loose", SLO(LOOSE, 40), 3)),
        # Headers too, and the body beats a header.
        ({"slo_class": "strict"}, {c.SLO_TTFT_HEADER: "900"}, ("strict", SLO(900, LOOSE), 0)),
        ({"slo": {"ttft_ms": 800}}, {c.SLO_CLASS_HEADER: "strict", c.SLO_TTFT_HEADER: "900"},
         ("strict", SLO(800, LOOSE), 0)),
        # A given priority beats the class's, 0 included.
        ({"slo_class": "loose", "priority": 7}, {}, ("loose", SLO(LOOSE, LOOSE), 7)),
        ({"slo_class": "loose", "priority": 0}, {}, ("loose", SLO(LOOSE, LOOSE), 0)),
        ({"priority": -2}, {}, (c.DEFAULT_SLO_CLASS, SLO(LOOSE, LOOSE), -2)),
        # The body's class beats the header's.
        ({"slo_class": "loose"}, {c.SLO_CLASS_HEADER: "strict"}, ("loose", SLO(LOOSE, LOOSE), 3)),
    ],
)  # fmt: skip
async def test_override_rules(server, admitted, body, headers, expected):
    status, payload = await post(server, body, headers)
    assert status == 200, payload
    (req,) = admitted
    assert (req.slo_class, req.slo, req.priority) == expected


async def test_unknown_class_is_an_openai_400_naming_the_known_classes(server, admitted):
    for chat in (False, True):
        for stream in (False, True):
            for body, headers, param in (
                ({"slo_class": "gold"}, {}, "slo_class"),
                ({}, {c.SLO_CLASS_HEADER: "gold"}, None),
                ({"slo_class": "default2"}, {c.SLO_CLASS_HEADER: "loose"}, "slo_class"),
                ({"slo_class": ""}, {}, "slo_class"),
                ({}, {c.SLO_CLASS_HEADER: "Loose"}, None),
            ):
                status, payload = await post(server, {**body, "stream": stream}, headers, chat=chat)
                assert status == 400, payload
                error = payload["error"]
                assert error["type"] == "invalid_request_error" and error["code"] == "unknown_slo_class"
                assert error["param"] == param
                assert "default, loose, strict" in error["message"]
    assert admitted == []  # refused before reaching the engine
    status, payload = await post(server, {"slo_class": "loose"})
    assert status == 200 and payload["usage"]["completion_tokens"] >= 1


async def test_metrics_are_labelled_by_class(server):
    for _ in range(2):
        assert (await post(server, {"slo_class": "loose", "max_tokens": 4, "ignore_eos": True}))[0] == 200
    assert (await post(server, {"slo_class": "strict", "max_tokens": 4, "ignore_eos": True}))[0] == 200
    assert (await post(server, {"max_tokens": 4, "ignore_eos": True}))[0] == 200
    reg = server.server.core.metrics.registry

    def value(name: str, **labels: str) -> float | None:
        return reg.get_sample_value(c.metric(name), {"model_name": MODEL, **labels})

    slo = "slo_requests_total"
    assert value(slo, slo_class="loose", ttft="met", tbt="met") == 2.0
    assert value(slo, slo_class="strict", ttft="missed", tbt="met") == 1.0
    assert value(slo, slo_class="strict", ttft="met", tbt="met") is None
    assert value(slo, slo_class="default", ttft="met", tbt="met") == 1.0
    for cls, n in (("loose", 2.0), ("strict", 1.0), ("default", 1.0)):
        assert value("time_to_first_token_seconds_count", slo_class=cls) == n
        assert value("time_between_tokens_seconds_count", slo_class=cls) == 3 * n  # 4 tokens: 3 gaps each
    assert value("slo_target_seconds", kind="ttft", slo_class="strict") == STRICT / 1000
    assert value("slo_target_seconds", kind="tbt", slo_class="loose") == LOOSE / 1000
    assert value("slo_target_seconds", kind="ttft", slo_class="default") == LOOSE / 1000
    # Every class's threshold is a bucket bound, so attainment per class is exact from the histogram.
    buckets = {
        (s.labels["slo_class"], float(s.labels["le"])): s.value
        for fam in reg.collect()
        for s in fam.samples
        if s.name == c.metric("time_to_first_token_seconds_bucket")
    }
    assert buckets[("loose", LOOSE / 1000)] == 2.0
    assert buckets[("strict", STRICT / 1000)] == 0.0


async def test_builtin_class_buckets_include_every_threshold():
    running = await start_server(
        EngineConfig(
            engine_process=False,  # the tests read the engine core's state
            model="tiny",
            device="cpu",
            port=0,
            max_model_len=128,
            num_gpu_blocks=32,
            ttft_slo_ms=1234,
        )
    )
    try:
        assert (await post_to(running, "tiny", {"prompt": "x", "max_tokens": 3, "ignore_eos": True}))[0] == 200
        registry = running.server.core.metrics.registry
        bounds = {
            name: {float(s.labels["le"]) for fam in registry.collect() for s in fam.samples if s.name == c.metric(name)}
            for name in ("time_to_first_token_seconds_bucket", "time_between_tokens_seconds_bucket")
        }
    finally:
        await running.close()
    assert {0.5, 30.0, 1.234} <= bounds["time_to_first_token_seconds_bucket"]  # interactive, batch, default
    assert {0.1, 1.0} <= bounds["time_between_tokens_seconds_bucket"]


# ---- the benchmarks' replay ------------------------------------------------------------------


def test_replay_passes_each_labelled_item_its_class():
    """workload.replay (the `slo` benchmark's engine driver) gives an item labelled with a known SLO
    class that class, and any other label the default one."""
    core = EngineCore(EngineConfig(model="tiny", device="cpu", engine_process=False))
    items = [WorkItem(0.0, 8, 3, SLO(), label) for label in ("interactive", "batch", "batch", "long")]
    replay(core, items, [[20 + i] * 8 for i in range(len(items))])
    reg = core.metrics.registry
    counts = {
        cls: reg.get_sample_value(
            c.metric("time_to_first_token_seconds_count"), {"model_name": "tiny", "slo_class": cls}
        )
        for cls in ("interactive", "batch", "default")
    }
    assert counts == {"interactive": 1.0, "batch": 2.0, "default": 1.0}
