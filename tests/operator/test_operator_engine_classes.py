"""A real engine's class-labelled /metrics, scraped into a window, drive decide() class by class."""

from __future__ import annotations

import json
from dataclasses import replace

import aiohttp
import pytest

from superinfer.engine import contract
from superinfer.operator.api.inference_service import InferenceServiceSpec
from superinfer.operator.autoscaling import pod_metrics
from superinfer.operator.autoscaling.decision import Memory, Observation, Params, decide

server_module = pytest.importorskip("superinfer.engine.serving.server", reason="awaits the engine")
config_module = pytest.importorskip("superinfer.engine.config")

MODEL = "tiny-autoscale"
# `lax` takes whatever it gets; nothing can meet `strict`. The spec knows neither class, so their
# targets can only come from the engine's slo_target_seconds.
CLASSES = {"lax": {"ttft_ms": 1e9, "tbt_ms": 1e9}, "strict": {"ttft_ms": 1e-5, "tbt_ms": 1e9}}
SPEC = InferenceServiceSpec.model_validate(
    {
        "model": {"uri": "preset://tiny"},
        # A TTFT target nothing meets: pooled and held to it, any traffic would look like distress.
        "slo": {"ttftMs": 0.01, "tbtMs": 1e9, "attainmentTarget": 0.4},
        "autoscaling": {"enabled": True, "minRequests": 3},
    }
)


@pytest.fixture
async def engine():
    running = await server_module.start_server(
        config_module.EngineConfig(
            model="tiny",
            served_model_name=MODEL,
            device="cpu",
            port=0,
            max_model_len=128,
            num_gpu_blocks=32,
            slo_classes=json.dumps(CLASSES),
        )
    )
    yield running
    await running.close()


async def complete(http: aiohttp.ClientSession, url: str, slo_class: str, n: int) -> None:
    body = {"model": MODEL, "prompt": "x", "max_tokens": 4, "ignore_eos": True, "slo_class": slo_class}
    for _ in range(n):
        async with http.post(url + contract.COMPLETIONS_PATH, json=body) as resp:
            assert resp.status == 200, await resp.text()


async def test_each_class_is_held_to_the_targets_its_engine_exports(engine):
    params = Params.from_spec(SPEC)
    window = pod_metrics.Window(seconds=60)
    metrics_url = engine.url + contract.METRICS_PATH
    async with aiohttp.ClientSession() as http:
        window.add("pod", pod_metrics.parse(await pod_metrics.fetch(http, metrics_url), now=0, model_name=MODEL))
        await complete(http, engine.url, "lax", 4)
        window.add("pod", pod_metrics.parse(await pod_metrics.fetch(http, metrics_url), now=10, model_name=MODEL))
        lax_only = window.stats(now=10, fresh_seconds=30)
        await complete(http, engine.url, "strict", 4)
        window.add("pod", pod_metrics.parse(await pod_metrics.fetch(http, metrics_url), now=20, model_name=MODEL))
        both = window.stats(now=20, fresh_seconds=30)
    memory = Memory(started_at=-1000)

    assert lax_only is not None and set(lax_only.classes) == {"lax"}
    lax = lax_only.classes["lax"]
    assert (lax.requests, lax.attainment, lax.ttft_target_ms) == (4, 1.0, 1e9)
    assert lax.ttft_p90_ms is not None and lax.ttft_p90_ms > params.ttft_slo_ms
    assert decide(Observation(20, 2, 2, 0, 0, lax_only), params, memory).action == "Hold"
    # With requests queued (none queued, the TTFT misses would be of requests placed before: no
    # reason for more pods), judging all requests against slo.ttftMs would scale up; per class, not.
    queued = replace(lax_only, waiting=6, pods_with_room=0)
    assert decide(Observation(20, 2, 2, 0, 0, queued), params, memory).action == "Hold"
    pooled = decide(Observation(20, 2, 2, 0, 0, replace(queued, classes={})), params, memory)
    assert pooled.action == "ScaleUp"

    assert both is not None and set(both.classes) == {"lax", "strict"}
    strict = both.classes["strict"]
    assert (strict.requests, strict.attainment, strict.ttft_target_ms) == (4, 0.0, pytest.approx(1e-5))
    d = decide(Observation(20, 2, 2, 0, 0, replace(both, waiting=6, pods_with_room=0)), params, memory)
    assert (d.action, d.reason, d.target) == ("ScaleUp", "SLODistress", 4)
    assert "(class strict)" in d.message and "class lax" not in d.message, d.message
