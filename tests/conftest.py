"""Shared test setup: `gpu`-marked tests skip cleanly where no CUDA device exists; property-based
tests are derandomized under CI (reproducible there; local runs keep exploring new examples)."""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

SERVED_MODEL = "tiny-test"  # the name the `server` fixture serves the tiny model under

settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=[False, True], ids=["sync", "async-scheduling"])
async def server(request):
    """The tiny model behind the HTTP server, with synchronous and with async scheduling. The
    engine runs on a thread here, so tests can look at its scheduler and metrics; the engine
    process (the default) is served and tested in test_engine_process.py."""
    from superinfer.engine.config import EngineConfig
    from superinfer.engine.serving.server import start_server

    running = await start_server(
        EngineConfig(
            model="tiny",
            served_model_name=SERVED_MODEL,
            device="cpu",
            port=0,
            max_model_len=256,
            num_gpu_blocks=64,
            max_request_bytes=64 * 1024,
            async_scheduling=request.param,
            engine_process=False,
        )
    )
    yield running
    await running.close()


@pytest.fixture
async def client(server):
    """The official openai client against `server`."""
    import openai

    async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as cl:
        yield cl
