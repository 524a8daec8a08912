"""Load generation against any OpenAI-compatible endpoint, measured with the SLO definitions.

A streamed chunk may carry several tokens (vLLM merges them when its API server falls behind; both
servers hold back a token whose bytes end mid-character), so every request asks for
`stream_options.continuous_usage_stats`: each chunk reports the running token count, and each of
a chunk's tokens is timed at the chunk's arrival. Arrival is when the request is sent.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from superinfer.engine.contract import COMPLETIONS_PATH
from superinfer.engine.slo import SLO
from superinfer.workload.arrivals import WorkItem
from superinfer.workload.goodput import RequestTiming, summarize


@dataclass(frozen=True)
class LoadRequest:
    prompt: str | list[int]
    max_tokens: int
    slo: SLO = field(default_factory=SLO)
    delay_s: float = 0.0  # send this long after the run starts (open-loop arrivals)
    slo_class: str | None = None  # sent as the body field `slo_class` (servers without classes ignore it)
    fields: dict[str, Any] = field(default_factory=dict)  # more body fields (e.g. a structured-output constraint)


async def stream_completion(
    session: aiohttp.ClientSession,
    base_url: str,
    model: str,
    req: LoadRequest,
) -> RequestTiming:
    body = {
        "model": model,
        "prompt": req.prompt,
        "max_tokens": req.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "temperature": 0,
        "ignore_eos": True,
        "slo": {"ttft_ms": req.slo.ttft_ms, "tbt_ms": req.slo.tbt_ms},
        **({"slo_class": req.slo_class} if req.slo_class else {}),
        **req.fields,
    }
    sent = time.monotonic()
    times: list[float] = []
    async with session.post(base_url + COMPLETIONS_PATH, json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {await resp.text()}")
        async for line in resp.content:
            if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
                chunk = json.loads(line[6:])
                if "error" in chunk:  # the server failed mid-stream: not a token
                    raise RuntimeError(f"stream error: {chunk['error'].get('message')}")
                times += [time.monotonic()] * chunk_tokens(chunk, len(times))
    return RequestTiming(sent, tuple(times), req.slo)


def chunk_tokens(chunk: dict[str, Any], seen: int) -> int:
    """Output tokens a streamed chunk carries, by its running usage count (continuous usage stats);
    one per chunk with choices from a server that sends no count; a usage-only chunk carries none."""
    if not chunk.get("choices"):
        return 0
    usage = chunk.get("usage")
    if usage and usage.get("completion_tokens") is not None:
        return max(0, usage["completion_tokens"] - seen)
    return 1


async def run_load(base_url: str, model: str, requests: Sequence[LoadRequest]) -> tuple[list[RequestTiming], float]:
    """Send every request at its delay (open loop); returns the timings and the run's duration."""
    start = time.monotonic()

    async def one(session: aiohttp.ClientSession, req: LoadRequest) -> RequestTiming:
        await asyncio.sleep(max(0.0, start + req.delay_s - time.monotonic()))
        sent = time.monotonic()
        try:
            return await stream_completion(session, base_url, model, req)
        except (aiohttp.ClientError, RuntimeError) as exc:  # one failed request, not a failed run
            return RequestTiming(sent, (), req.slo, error=f"{type(exc).__name__}: {exc}")

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        timings = await asyncio.gather(*(one(session, r) for r in requests))
    return list(timings), time.monotonic() - start


WORDS = (
    "the",
    "river",
    "light",
    "quiet",
    "market",
    "stone",
    "winter",
    "paper",
    "garden",
    "signal",
    "harbor",
    "morning",
    "engine",
    "forest",
    "letter",
    "bridge",
    "cloud",
    "window",
    "silver",
    "story",
)


def text_prompt(num_words: int, seed: int) -> str:
    """A prompt of about `num_words` tokens for any tokenizer (common English words)."""
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


async def bench_endpoint(base_url: str, model: str, items: Sequence[WorkItem]) -> dict[str, float]:
    """Open-loop load of `items` against an OpenAI-compatible endpoint; the SLO report."""
    load = [
        LoadRequest(text_prompt(it.prompt_len, i), it.output_len, it.slo, it.arrival_s) for i, it in enumerate(items)
    ]
    timings, duration = await run_load(base_url, model, load)
    return summarize(timings, duration)
