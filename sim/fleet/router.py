"""Routers: which ready replica takes a request, from what each would know at that moment.

- `round-robin`: a Kubernetes Service (kube-proxy) or a plain proxy, nothing scraped;
- `least-outstanding`: a proxy counting its own requests in flight per endpoint (Envoy's
  LEAST_REQUEST, here over all endpoints rather than its default two random choices);
- `epp`: the Gateway API Inference Extension endpoint picker with its default scheduling profile
  (config/charts/inferencepool/templates/epp-config.yaml: queue-scorer weight 2,
  kv-cache-utilization-scorer weight 2, prefix-cache-scorer weight 3; max score wins, ties at
  random), reading vllm:num_requests_waiting and vllm:kv_cache_usage_perc from each pod's last
  scrape (its default refresh is 50 ms);
- `epp-rotary`: the same picker and weights reading the signals a rotary engine could export
  under those names instead: waiting including rotated-out requests, and KV usage of the demand
  (the GPU's usage scaled by live streams over resident ones) rather than of the pool;
- `slo`: our own scorer: queue including rotated-out requests (weight 2), lag behind the SLO of
  the most-late request not running (superinfer_engine_slo_lag_seconds, weight 2), running
  requests (weight 1) and prefix affinity (weight 3).

Scorers return [0, 1] per endpoint, higher is better; queue-like signals are min-max normalised
over the candidates as the stock queue-scorer does (all equal: 1 for everyone).
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from superinfer.sim.fleet.scrape import PodView

PREFIX_BLOCK_TOKENS = 64  # the prefix-cache-scorer's hash block size (its documented default)
PREFIX_MAX_BLOCKS = 256  # maxPrefixBlocksToMatch
PREFIX_LRU_PER_SERVER = 31250  # lruCapacityPerServer


@dataclass(frozen=True)
class Endpoint:
    """A ready replica as the router knows it: its last scrape and the requests it sent there."""

    name: str
    view: PodView
    outstanding: int


def min_max_low(values: Mapping[str, float]) -> dict[str, float]:
    """Lower is better, scaled to [0, 1] over the candidates (all equal: 1 each), as queue-scorer."""
    lo, hi = min(values.values()), max(values.values())
    if hi == lo:
        return dict.fromkeys(values, 1.0)
    return {name: (hi - v) / (hi - lo) for name, v in values.items()}


def waiting_with_rotary(view: PodView) -> float:
    """Requests admitted but not being served: queued ones and those rotated out to the CPU tier."""
    return view.waiting + view.rotary


def kv_demand(view: PodView) -> float:
    """KV usage of the demand rather than of the pool: the GPU's usage scaled by the live streams
    over those resident on the GPU (1 and more: rotated-out streams want blocks too), at most 1."""
    if view.running <= 0:
        return view.kv_gpu
    return min(1.0, view.kv_gpu * (view.running + view.rotary) / view.running)


class PrefixIndex:
    """The prefix-cache-scorer's approximate index: hashes of the 64-token blocks of the prompts it
    sent to each server (an LRU per server), not what the server really caches."""

    def __init__(self, capacity: int = PREFIX_LRU_PER_SERVER) -> None:
        self.capacity = capacity
        self.servers: dict[str, OrderedDict[int, None]] = {}

    @staticmethod
    def block_hashes(prompt: Sequence[int]) -> list[int]:
        """Chained hashes of the prompt's full blocks (each depends on every block before it)."""
        out, h = [], 0
        for start in range(0, min(len(prompt), PREFIX_BLOCK_TOKENS * PREFIX_MAX_BLOCKS), PREFIX_BLOCK_TOKENS):
            block = prompt[start : start + PREFIX_BLOCK_TOKENS]
            if len(block) < PREFIX_BLOCK_TOKENS:
                break
            h = hash((h, tuple(block)))
            out.append(h)
        return out

    def score(self, hashes: Sequence[int], server: str) -> float:
        """The share of the prompt's blocks that match, in order from the start, on `server`."""
        known = self.servers.get(server)
        if not hashes or not known:
            return 0.0
        matched = 0
        for h in hashes:
            if h not in known:
                break
            matched += 1
        return matched / len(hashes)

    def record(self, hashes: Sequence[int], server: str) -> None:
        lru = self.servers.setdefault(server, OrderedDict())
        for h in hashes:
            lru[h] = None
            lru.move_to_end(h)
        while len(lru) > self.capacity:
            lru.popitem(last=False)

    def forget(self, server: str) -> None:
        self.servers.pop(server, None)


class Router:
    """Picks a ready endpoint for each request; `done` hears of each finished request."""

    name = "router"

    def pick(self, prompt: Sequence[int], endpoints: Sequence[Endpoint]) -> str:
        raise NotImplementedError

    def forget(self, server: str) -> None:
        """A replica left the endpoints."""


class RoundRobin(Router):
    name = "round-robin"

    def __init__(self) -> None:
        self.turn = 0

    def pick(self, prompt: Sequence[int], endpoints: Sequence[Endpoint]) -> str:
        choice = endpoints[self.turn % len(endpoints)].name
        self.turn += 1
        return choice


class LeastOutstanding(Router):
    """The endpoint with the fewest of this router's requests in flight (ties: in turn)."""

    name = "least-outstanding"

    def __init__(self) -> None:
        self.turn = 0

    def pick(self, prompt: Sequence[int], endpoints: Sequence[Endpoint]) -> str:
        self.turn += 1
        n = len(endpoints)
        rotated = [endpoints[(self.turn + i) % n] for i in range(n)]
        return min(rotated, key=lambda e: e.outstanding).name


Scorer = Callable[[Sequence[Endpoint]], dict[str, float]]


def queue_scorer(signal: Callable[[PodView], float]) -> Scorer:
    return lambda endpoints: min_max_low({e.name: signal(e.view) for e in endpoints})


def kv_scorer(signal: Callable[[PodView], float]) -> Scorer:
    return lambda endpoints: {e.name: 1.0 - signal(e.view) for e in endpoints}


def _vllm_waiting(view: PodView) -> float:
    return view.vllm_waiting


def _vllm_kv(view: PodView) -> float:
    return view.vllm_kv_usage


def _slo_lag(view: PodView) -> float:
    return view.slo_lag_s


def _running(view: PodView) -> float:
    return view.running


class WeightedScorer(Router):
    """The endpoint picker's scheduling profile: a weighted sum of scorers (each clamped to
    [0, 1]), prefix affinity among them, the highest total wins, ties at random."""

    def __init__(self, name: str, scorers: Sequence[tuple[float, Scorer]], prefix_weight: float, seed: int = 0):
        self.name = name
        self.scorers = list(scorers)
        self.prefix_weight = prefix_weight
        self.prefix = PrefixIndex()
        self.rng = random.Random(seed)

    def totals(self, prompt: Sequence[int], endpoints: Sequence[Endpoint]) -> tuple[dict[str, float], list[int]]:
        totals = dict.fromkeys((e.name for e in endpoints), 0.0)
        for weight, scorer in self.scorers:
            for name, score in scorer(endpoints).items():
                totals[name] += weight * min(1.0, max(0.0, score))
        hashes = self.prefix.block_hashes(prompt) if self.prefix_weight else []
        if hashes:
            for name in totals:
                totals[name] += self.prefix_weight * self.prefix.score(hashes, name)
        return totals, hashes

    def pick(self, prompt: Sequence[int], endpoints: Sequence[Endpoint]) -> str:
        totals, hashes = self.totals(prompt, endpoints)
        best = max(totals.values())
        choice = self.rng.choice([name for name, total in totals.items() if total >= best - 1e-12])
        if hashes:
            self.prefix.record(hashes, choice)
        return choice

    def forget(self, server: str) -> None:
        self.prefix.forget(server)


def endpoint_picker(seed: int = 0) -> WeightedScorer:
    """The stock picker's default profile on the stock vLLM metric names."""
    return WeightedScorer("epp", [(2.0, queue_scorer(_vllm_waiting)), (2.0, kv_scorer(_vllm_kv))], 3.0, seed)


def endpoint_picker_rotary(seed: int = 0) -> WeightedScorer:
    """The stock picker's default profile, its two metrics saying what a rotary engine's load is."""
    scorers = [(2.0, queue_scorer(waiting_with_rotary)), (2.0, kv_scorer(kv_demand))]
    return WeightedScorer("epp-rotary", scorers, 3.0, seed)


def slo_scorer(seed: int = 0) -> WeightedScorer:
    """Our signals: backlog with rotated-out requests, SLO lag, running requests, prefix affinity."""
    scorers = [(2.0, queue_scorer(waiting_with_rotary)), (2.0, queue_scorer(_slo_lag)), (1.0, queue_scorer(_running))]
    return WeightedScorer("slo", scorers, 3.0, seed)


ROUTERS: dict[str, Callable[[int], Router]] = {
    "round-robin": lambda seed: RoundRobin(),
    "least-outstanding": lambda seed: LeastOutstanding(),
    "epp": endpoint_picker,
    "epp-rotary": endpoint_picker_rotary,
    "slo": slo_scorer,
}


def make_router(name: str, seed: int = 0) -> Router:
    if name not in ROUTERS:
        raise ValueError(f"unknown router {name!r}; choose one of {', '.join(ROUTERS)}")
    return ROUTERS[name](seed)
