"""The messages between the front end and the engine loop.

Commands go in through a queue to the engine's thread, or pickled through the pipe to the engine
process (engine/process.py); the engine process answers with the messages below them. Each is a
NamedTuple, except the one per running request in every step's `Outputs` (see `WireOutput`).
"""

from __future__ import annotations

from typing import Any, NamedTuple, TypeAlias

from superinfer.engine.core.request import SamplingParams
from superinfer.engine.slo import SLO
from superinfer.engine.worker.runner import TokenLogprob


# --- front end -> engine -----------------------------------------------------------------------
class AddRequest(NamedTuple):
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    slo: SLO | None
    priority: int | None
    arrival: float  # time.monotonic(), the same clock in both processes
    slo_class: str
    after: str | None  # a live request with the same prompt: start once it has computed it


class Abort(NamedTuple):
    """The client left."""

    request_id: str


class Finish(NamedTuple):
    """A stop string matched in the front end's text: the engine ends the request with "stop"."""

    request_id: str


class Scrape(NamedTuple):
    """The engine's /metrics page, asked of the engine process."""

    scrape_id: int


class Stop(NamedTuple):
    """After the current step (the server has drained)."""


Command = AddRequest | Abort | Finish | Scrape | Stop


# --- engine process -> front end ---------------------------------------------------------------
# A RequestOutput without its text (the front end detokenizes): token ids, logprobs, finished,
# finish reason, prompt tokens, output tokens, cached tokens, prompt logprobs. A plain tuple, not
# a NamedTuple: there is one per running request per step, and a NamedTuple is built and
# unpickled by Python code (256 of them: 1.6 ms a step through the pipe against 0.4 ms, in
# bench/results/wire-cpu-2026-11-29.json from `python -m bench.wire`).
WireOutput: TypeAlias = tuple[
    list[int], list[TokenLogprob] | None, bool, str | None, int, int, int, list[TokenLogprob | None] | None
]


class Ready(NamedTuple):
    info: Any  # process.CoreInfo


class StartFailed(NamedTuple):
    error: BaseException


class Outputs(NamedTuple):
    """One step's outputs (or a request's refusal), and the queues' sizes after it."""

    items: list[tuple[str, WireOutput | BaseException]]
    counts: tuple[int, int, int]  # running, waiting, rotary


class MetricsPage(NamedTuple):
    scrape_id: int
    text: bytes


class Died(NamedTuple):
    """A step failed or a rank died; the engine process then exits 1."""

    message: str
