"""Workloads for SLO experiments: open-loop arrivals and request lengths, reproducible by seed.

The evaluation protocol (docs/rotasched.md): Poisson arrivals (gamma inter-arrival times, burstiness 1),
fixed output length per request, greedy decoding with `ignore_eos`. Traces are JSONL lines
{"prompt": ..., "generated": ...} or ShareGPT JSON; without one, synthetic lengths are drawn from
a log-normal fitted by eye to ShareGPT's shape (prompts median ~150 tokens, outputs ~200),
clipped to the protocol's limits (prompts <= 1024, outputs <= 8192), scaled by the caller.

Azure's LLM inference traces (CSV `TIMESTAMP,ContextTokens,GeneratedTokens`, from
github.com/Azure/AzurePublicDataset) carry arrival times too: `azure_trace` replays them, compressed
by a speed-up, over a window of the trace. They are read from a path and never committed here.
"""

from __future__ import annotations

import csv
import datetime as dt
import functools
import gzip
import json
import math
import random
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

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


AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
# `2023-11-16 18:15:46.6805900`: Python 3.10's datetime parsers take at most 6 fractional digits,
# the traces have 7; an optional UTC offset is accepted too.
_STAMP = re.compile(r"(\d{4})-(\d\d)-(\d\d)[ T](\d\d):(\d\d):(\d\d)(?:\.(\d+))?\s*(Z|[+-]\d\d:?\d\d)?")


@functools.lru_cache(maxsize=64)
def _day_seconds(year: int, month: int, day: int) -> int:
    return (dt.date(year, month, day) - dt.date(1970, 1, 1)).days * 86400


def stamp_seconds(stamp: str) -> float:
    """Seconds since the epoch (UTC) of a trace timestamp such as `2023-11-16 18:15:46.6805900`."""
    m = _STAMP.fullmatch(stamp.strip())
    if m is None:
        raise ValueError(f"not a trace timestamp (YYYY-MM-DD HH:MM:SS[.fraction]): {stamp!r}")
    year, month, day, hour, minute, second = (int(g) for g in m.groups()[:6])
    fraction, offset = m.group(7), m.group(8)
    seconds = _day_seconds(year, month, day) + hour * 3600 + minute * 60 + second
    if offset and offset != "Z":
        sign = -1 if offset[0] == "-" else 1
        digits = offset[1:].replace(":", "")
        seconds -= sign * (int(digits[:2]) * 3600 + int(digits[2:]) * 60)
    return seconds + (float(f"0.{fraction}") if fraction else 0.0)


def format_stamp(t: dt.datetime) -> str:
    """`t` as the traces write it: seven fractional digits (100 ns ticks; datetime holds microseconds)."""
    return f"{t:%Y-%m-%d %H:%M:%S}.{t.microsecond:06d}0"


def _open_text(path: Path) -> TextIO:
    return gzip.open(path, "rt", newline="") if path.suffix == ".gz" else path.open(newline="")


def is_arrival_trace(path: Path) -> bool:
    """A CSV (or .csv.gz) trace replays its own arrivals; JSONL / ShareGPT traces only give lengths."""
    suffixes = [s.lower() for s in path.suffixes[-2:]]
    return suffixes[-1:] == [".csv"] or suffixes == [".csv", ".gz"]


def parse_azure_rows(lines: Iterable[str], source: str = "trace") -> list[tuple[float, int, int]]:
    """(seconds since the epoch, context tokens, generated tokens) of each row, in arrival order."""
    reader = csv.reader(lines)
    header = [h.strip() for h in next(reader, [])]
    missing = [c for c in AZURE_COLUMNS if c not in header]
    if missing:
        raise ValueError(
            f"{source} is not an Azure LLM inference trace: it lacks the column(s) {', '.join(missing)} "
            f"(header {','.join(header) or 'empty'}; expected {','.join(AZURE_COLUMNS)})"
        )
    at, prompt, output = (header.index(c) for c in AZURE_COLUMNS)
    rows = []
    for n, row in enumerate(reader, start=2):
        if not row:
            continue
        try:
            rows.append((stamp_seconds(row[at]), int(row[prompt]), int(row[output])))
        except (ValueError, IndexError) as exc:
            raise ValueError(f"{source}, line {n}: {exc}") from exc
    rows.sort(key=lambda r: r[0])
    return rows


def read_azure_rows(path: Path) -> list[tuple[float, int, int]]:
    with _open_text(path) as f:
        return parse_azure_rows(f, str(path))


def scale_length(tokens: int, scale: float, hi: int) -> int:
    """`tokens` times `scale`, clamped to [1, hi]."""
    return min(hi, max(1, round(tokens * scale)))


def replay_rows(
    rows: Sequence[tuple[float, int, int]],
    speedup: float = 1.0,
    length_scale: float = 1.0,
    start_s: float = 0.0,
    duration_s: float | None = None,
    max_prompt: int = 1024,
    max_output: int = 8192,
    slo: SLO | None = None,
    label: str = "",
) -> list[WorkItem]:
    """The rows whose offset from the first row falls in [start_s, start_s + duration_s), arriving
    at (offset - start_s) / speedup, lengths times `length_scale`."""
    if not speedup > 0 or not length_scale > 0:
        raise ValueError(f"speedup and length scale must be positive, got {speedup:g} and {length_scale:g}")
    if start_s < 0 or (duration_s is not None and not duration_s > 0):
        raise ValueError(f"the window needs start >= 0 and duration > 0, got {start_s:g} and {duration_s}")
    if not rows:
        raise ValueError("the trace has no rows")
    first, end = rows[0][0], math.inf if duration_s is None else start_s + duration_s
    items = [
        WorkItem(
            (t - first - start_s) / speedup,
            scale_length(p, length_scale, max_prompt),
            scale_length(g, length_scale, max_output),
            slo or SLO(),
            label,
        )
        for t, p, g in rows
        if start_s <= t - first < end
    ]
    if not items:
        span = rows[-1][0] - first
        raise ValueError(f"no requests in the window [{start_s:g}, {end:g}) s of a trace that spans {span:.1f} s")
    return items


def azure_trace(
    path: Path,
    speedup: float = 1.0,
    length_scale: float = 1.0,
    start_s: float = 0.0,
    duration_s: float | None = None,
    max_prompt: int = 1024,
    max_output: int = 8192,
    slo: SLO | None = None,
    label: str = "",
) -> list[WorkItem]:
    """An Azure LLM inference trace's requests with their own arrival times (see `replay_rows`)."""
    rows = read_azure_rows(Path(path))
    return replay_rows(rows, speedup, length_scale, start_s, duration_s, max_prompt, max_output, slo, label)


def mean_rate(items: Sequence[WorkItem]) -> float:
    """Requests per second of a replayed trace, from its first to its last arrival."""
    if len(items) < 2:
        raise ValueError("a rate needs at least two requests")
    times = [i.arrival_s for i in items]
    span = max(times) - min(times)
    return (len(items) - 1) / span if span > 0 else math.inf


def write_azure_trace(path: Path, items: Sequence[WorkItem], t0: dt.datetime) -> Path:
    """`items` as an Azure trace (arrivals after `t0`, prompt and output lengths): small test traces."""
    with Path(path).open("w", newline="") as f:
        out = csv.writer(f, lineterminator="\n")
        out.writerow(AZURE_COLUMNS)
        for i in sorted(items, key=lambda i: i.arrival_s):
            stamp = format_stamp(t0 + dt.timedelta(seconds=i.arrival_s))
            out.writerow((stamp, i.prompt_len, i.output_len))
    return Path(path)
