"""Workloads for SLO experiments: open-loop arrivals and request lengths, reproducible by seed.

The evaluation protocol (docs/rotasched.md): Poisson arrivals (gamma inter-arrival times, burstiness 1),
fixed output length per request, greedy decoding with `ignore_eos`. Traces are JSONL lines
{"prompt": ..., "generated": ...} or ShareGPT JSON; without one, synthetic lengths are drawn from
a log-normal fitted by eye to ShareGPT's shape (prompts median ~150 tokens, outputs ~200),
clipped to the protocol's limits (prompts <= 1024, outputs <= 8192), scaled by the caller.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from superinfer.engine.slo import SLO


@dataclass(frozen=True)
class WorkItem:
    arrival_s: float
    prompt_len: int
    output_len: int
    slo: SLO = field(default_factory=SLO)
    label: str = ""  # the request's class in mixed workloads ("interactive", "batch", "long", ...)


def gamma_arrivals(rate: float, n: int, seed: int = 0, burstiness: float = 1.0, start: float = 0.0) -> list[float]:
    """n arrival times at `rate` per second; burstiness 1 is Poisson, below 1 is burstier."""
    if rate <= 0 or burstiness <= 0:
        raise ValueError("rate and burstiness must be positive")
    rng = random.Random(seed)
    t, out = start, []
    for _ in range(n):
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
        out.append(t)
    return out


def lognormal_lengths(n: int, median: float, sigma: float, lo: int, hi: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [min(hi, max(lo, round(rng.lognormvariate(math.log(median), sigma)))) for _ in range(n)]


def poisson_workload(
    rate: float,
    duration_s: float,
    slo: SLO,
    seed: int = 0,
    prompt_median: float = 150,
    output_median: float = 200,
    max_prompt: int = 1024,
    max_output: int = 8192,
) -> list[WorkItem]:
    """The protocol's open-loop load: Poisson arrivals over `duration_s`, synthetic lengths."""
    n = max(1, round(rate * duration_s))
    arrivals = [t for t in gamma_arrivals(rate, n, seed) if t <= duration_s] or [0.0]
    prompts = lognormal_lengths(len(arrivals), prompt_median, 0.9, 4, max_prompt, seed + 1)
    outputs = lognormal_lengths(len(arrivals), output_median, 0.9, 4, max_output, seed + 2)
    return [WorkItem(t, p, o, slo) for t, p, o in zip(arrivals, prompts, outputs, strict=True)]


def burst_workload(
    slo: SLO,
    seed: int = 0,
    long_requests: int = 6,
    long_output: int = 240,
    burst: int = 24,
    burst_start_s: float = 0.5,
    burst_rate: float = 40.0,
    prompt_len: tuple[int, int] = (16, 64),
    burst_output: int = 24,
    long_prompt_len: tuple[int, int] | None = None,
) -> list[WorkItem]:
    """Head-of-line blocking in miniature: long decodes fill KV memory, then a burst arrives.

    Long requests draw their prompt lengths from `long_prompt_len` (default: `prompt_len`).
    """
    rng = random.Random(seed)
    long_prompt = long_prompt_len or prompt_len
    items = [WorkItem(0.01 * i, rng.randint(*long_prompt), long_output, slo, "long") for i in range(long_requests)]
    for t in gamma_arrivals(burst_rate, burst, seed, start=burst_start_s):
        items.append(WorkItem(t, rng.randint(*prompt_len), burst_output, slo, "short"))
    return items


@dataclass(frozen=True)
class RequestClass:
    """One class of a mixed load: its share of arrivals, its SLO and its median lengths."""

    label: str
    share: float
    slo: SLO
    prompt_median: float
    output_median: float


def mixed_workload(
    classes: Sequence[RequestClass],
    rate: float,
    duration_s: float,
    seed: int = 0,
    max_prompt: int = 1024,
    max_output: int = 8192,
) -> list[WorkItem]:
    """Poisson arrivals over `duration_s`, each drawn into a class by its share (labelled with it)."""
    total = sum(c.share for c in classes)
    if not classes or total <= 0 or any(c.share < 0 for c in classes):
        raise ValueError("classes need non-negative shares with a positive sum")
    n = max(1, round(rate * duration_s))
    arrivals = [t for t in gamma_arrivals(rate, n, seed) if t <= duration_s] or [0.0]
    rng = random.Random(seed + 1)
    picked = rng.choices(classes, weights=[c.share for c in classes], k=len(arrivals))
    items = []
    for t, c in zip(arrivals, picked, strict=True):
        prompt = min(max_prompt, max(4, round(rng.lognormvariate(math.log(c.prompt_median), 0.9))))
        output = min(max_output, max(4, round(rng.lognormvariate(math.log(c.output_median), 0.9))))
        items.append(WorkItem(t, prompt, output, c.slo, c.label))
    return items


def prompt_tokens(items: Sequence[WorkItem], vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Random prompt token ids for each item (distinct prompts: no accidental prefix sharing)."""
    rng, ids = random.Random(seed), range(16, vocab_size)
    return [rng.choices(ids, k=item.prompt_len) for item in items]


def load_trace(
    path: Path, rate: float, slo: SLO, tokens_per_char: float = 0.25, seed: int = 0, limit: int | None = None
) -> list[WorkItem]:
    """Lengths from a trace (JSONL {"prompt","generated"} or ShareGPT JSON), Poisson arrivals.

    Lengths are estimated from characters (about 4 per token) so no tokenizer is needed.
    """
    text = path.read_text()
    pairs: list[tuple[str, str]] = []
    if path.suffix == ".jsonl":
        for line in text.splitlines():
            if line.strip():
                row = json.loads(line)
                pairs.append((row["prompt"], row["generated"]))
    else:
        for conv in json.loads(text):
            turns = [t.get("value", "") for t in conv.get("conversations", [])]
            if len(turns) >= 2:
                pairs.append((turns[0], turns[1]))
    pairs = pairs[:limit] if limit else pairs
    if not pairs:
        raise ValueError(f"no prompt/response pairs found in {path}")

    def tokens(text: str, limit: int) -> int:
        return min(limit, max(1, round(len(text) * tokens_per_char)))

    arrivals = gamma_arrivals(rate, len(pairs), seed)
    return [WorkItem(t, tokens(p, 1024), tokens(g, 8192), slo) for t, (p, g) in zip(arrivals, pairs, strict=True)]
