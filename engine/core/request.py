"""A request as the scheduler sees it: tokens, sampling parameters, SLO, state and timings."""

from __future__ import annotations

import enum
import math
from collections.abc import MutableSequence
from dataclasses import dataclass, field
from typing import Protocol

from superinfer.engine.contract import DEFAULT_SLO_CLASS
from superinfer.engine.output_constraint import GuidedSpec
from superinfer.engine.slo import SLO


class SlotColumns(Protocol):
    """What a running request keeps in the scheduler's RunningBatch (core/running_batch.py): its
    counters, at its slot in each column, and the tails of its newest gaps and tokens."""

    computed: MutableSequence[int]
    pending: MutableSequence[int]
    last_step: MutableSequence[int]
    prev_step: MutableSequence[int]
    num_tokens: MutableSequence[int]
    tail_gaps: MutableSequence[int]
    tail_tokens: MutableSequence[int]
    t_last: MutableSequence[float]
    max_gap: MutableSequence[float]

    def flush_gaps(self, slot: int) -> None: ...

    def flush_tokens(self, slot: int) -> None: ...


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # never ran, or preempted by recompute
    RUNNING = "running"  # KV on the GPU, scheduled every step
    ROTARY = "rotary"  # KV parked in CPU memory, waiting for its next turn
    FINISHED = "finished"


# (A module global: on Python 3.11 looking up an Enum member costs ~0.2 µs, and is_finished is
# asked of every running request every step.)
_FINISHED = RequestStatus.FINISHED

SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # a 64-bit seed, as torch's generators take
GREEDY_TEMPERATURE = 1e-5  # and below: greedy (vLLM's threshold too)
# Past these a penalized float32 logit overflows (or a tiny penalty rounds to 0: -inf * 0 is NaN).
REPETITION_PENALTY_MIN, REPETITION_PENALTY_MAX = 0.01, 100.0


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) disables top-k
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # None: no logprobs; n >= 0: chosen token plus n alternatives
    prompt_logprobs: int | None = None  # also each prompt token's logprob (plus n alternatives)
    presence_penalty: float = 0.0  # OpenAI's: subtracted once from each token already generated
    frequency_penalty: float = 0.0  # OpenAI's: subtracted per occurrence in the generated tokens
    repetition_penalty: float = 1.0  # CTRL's, on prompt and output tokens: positive logits / p, others * p
    min_p: float = 0.0  # drop tokens less likely than min_p times the most likely one
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    guided: GuidedSpec | None = None  # structured output: the grammar every token must follow

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise ValueError(f"seed must be in [{SEED_MIN}, {SEED_MAX}] (64 bits), got {self.seed}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= 20:
                raise ValueError(f"{name} must be in [0, 20], got {value}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not REPETITION_PENALTY_MIN <= self.repetition_penalty <= REPETITION_PENALTY_MAX:
            raise ValueError(
                f"repetition_penalty must be in [{REPETITION_PENALTY_MIN}, {REPETITION_PENALTY_MAX}], "
                f"got {self.repetition_penalty}"
            )
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.guided is not None and self.min_tokens:
            # A finished grammar allows only EOS, which min_tokens bans: no token would be left.
            raise ValueError("min_tokens cannot be combined with structured output")

    @property
    def penalized(self) -> bool:
        """Sampling needs the request's token history (counts of output tokens, prompt tokens)."""
        return bool(self.presence_penalty or self.frequency_penalty) or self.repetition_penalty != 1.0

    @property
    def greedy(self) -> bool:
        """Below GREEDY_TEMPERATURE dividing the logits would overflow toward inf (and NaN
        probabilities) for what is greedy sampling anyway."""
        return self.temperature < GREEDY_TEMPERATURE


@dataclass(eq=False, slots=True)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_time: float
    eos_token_ids: frozenset[int] = frozenset()
    slo: SLO = field(default_factory=SLO)  # fixed once it runs (RunningBatch keeps its TBT SLO)
    priority: int = 0  # higher = more important: the class's unless the request gave its own
    slo_class: str = DEFAULT_SLO_CLASS

    status: RequestStatus = RequestStatus.WAITING
    # num_computed_tokens, num_pending_tokens, last_step, step_before_last, t_last_token and
    # max_gap_s: properties below.
    _num_computed_tokens: int = field(default=0, init=False, repr=False)
    _num_pending_tokens: int = field(default=0, init=False, repr=False)
    _last_step: int = field(default=0, init=False, repr=False)
    _step_before_last: int = field(default=0, init=False, repr=False)
    _t_last_token: float | None = field(default=None, init=False, repr=False)
    _max_gap_s: float = field(default=0.0, init=False, repr=False)
    _batch: SlotColumns | None = field(default=None, init=False, repr=False)  # while it runs
    _slot: int = field(default=-1, init=False, repr=False)
    block_ids: list[int] = field(default_factory=list)  # GPU block table; plans share it, so it is replaced, not grown
    block_hashes: list[bytes] = field(default_factory=list)  # prefix hash of each full block
    decoded_blocks: int = 0  # its first blocks its completed decode rows wrote (KVCacheManager.filled)
    cpu_block_ids: list[int] = field(default_factory=list)  # CPU copies of its first full blocks
    cpu_tail: int | None = None  # CPU copy of its partial last block while rotated out
    num_rotations: int = 0
    num_cached_tokens: int = 0  # prefix-cache hits at first admission
    num_preemptions: int = 0
    # Waits off the GPU past its stall budget (Scheduler.note_stall_overruns), and the time of the
    # last token before the latest one counted (each wait is counted once).
    stall_overruns: int = 0
    t_overrun_from: float = math.nan
    finish_reason: FinishReason | None = None
    t_first_token: float | None = None
    t_run: float | None = None  # last time it entered RUNNING
    _token_gaps: list[float] = field(default_factory=list, init=False, repr=False)  # token_gaps
    t_scheduled: float | None = None  # first time it was scheduled (queueing ends)
    _token_ids: list[int] = field(init=False, repr=False)  # token_ids
    # Tokens at which it ends by length: max_tokens out, or the context length once the scheduler
    # that takes it caps this (Scheduler.add).
    length_limit: int = field(init=False)
    stop_token_set: frozenset[int] = field(init=False)  # may stop it (EOS unless ignored, stop ids)

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("a request needs at least one prompt token")
        self._token_ids = list(self.prompt_token_ids)
        self.length_limit = len(self.prompt_token_ids) + self.sampling.max_tokens
        eos = frozenset() if self.sampling.ignore_eos else self.eos_token_ids
        self.stop_token_set = eos | frozenset(self.sampling.stop_token_ids)

    # The counters every step changes: in the scheduler's RunningBatch while the request runs
    # (that is where the scheduler updates them, in columns), in the request otherwise.
    @property
    def num_computed_tokens(self) -> int:
        """Tokens whose KV is (or, once the step runs, will be) in the cache."""
        batch = self._batch
        return self._num_computed_tokens if batch is None else batch.computed[self._slot]

    @num_computed_tokens.setter
    def num_computed_tokens(self, value: int) -> None:
        batch = self._batch
        if batch is None:
            self._num_computed_tokens = value
        else:
            batch.computed[self._slot] = value

    @property
    def num_pending_tokens(self) -> int:
        """Tokens sampled by a submitted step whose result is not back yet."""
        batch = self._batch
        return self._num_pending_tokens if batch is None else batch.pending[self._slot]

    @num_pending_tokens.setter
    def num_pending_tokens(self, value: int) -> None:
        batch = self._batch
        if batch is None:
            self._num_pending_tokens = value
        else:
            batch.pending[self._slot] = value

    @property
    def last_step(self) -> int:
        """The newest step that computes with its blocks."""
        batch = self._batch
        return self._last_step if batch is None else batch.last_step[self._slot]

    @last_step.setter
    def last_step(self, value: int) -> None:
        batch = self._batch
        if batch is None:
            self._last_step = value
        else:
            batch.last_step[self._slot] = value

    @property
    def step_before_last(self) -> int:
        """The step before last_step (it wrote the blocks that filled up before last_step)."""
        batch = self._batch
        return self._step_before_last if batch is None else batch.prev_step[self._slot]

    @step_before_last.setter
    def step_before_last(self, value: int) -> None:
        batch = self._batch
        if batch is None:
            self._step_before_last = value
        else:
            batch.prev_step[self._slot] = value

    @property
    def t_last_token(self) -> float | None:
        """When its newest token came out."""
        batch = self._batch
        if batch is None:
            return self._t_last_token
        t = batch.t_last[self._slot]
        return None if t != t else t  # NaN: none yet

    @t_last_token.setter
    def t_last_token(self, value: float | None) -> None:
        batch = self._batch
        if batch is None:
            self._t_last_token = value
        else:
            batch.t_last[self._slot] = math.nan if value is None else value

    @property
    def max_gap_s(self) -> float:
        """The longest of its token gaps (checked every step, so kept, not recomputed)."""
        batch = self._batch
        return self._max_gap_s if batch is None else batch.max_gap[self._slot]

    @max_gap_s.setter
    def max_gap_s(self, value: float) -> None:
        batch = self._batch
        if batch is None:
            self._max_gap_s = value
        else:
            batch.max_gap[self._slot] = value

    @property
    def token_gaps(self) -> list[float]:
        """Seconds between its output tokens. While it runs, the newest wait in its slot's tail in
        the RunningBatch, which reading them empties first."""
        batch = self._batch
        if batch is not None and batch.tail_gaps[self._slot]:
            batch.flush_gaps(self._slot)
        return self._token_gaps

    @property
    def token_ids(self) -> list[int]:
        """Its prompt, then its output (output_token_ids: a copy of the latter). While it runs,
        its newest tokens wait in its slot's tail in the RunningBatch, which reading them empties
        first: append to this list only what was read just now."""
        batch = self._batch
        if batch is not None and batch.tail_tokens[self._slot]:
            batch.flush_tokens(self._slot)
        return self._token_ids

    @token_ids.setter
    def token_ids(self, value: list[int]) -> None:
        if self._batch is not None:
            raise RuntimeError("a running request's tokens change only through the scheduler")
        self._token_ids = value

    @property
    def num_tokens(self) -> int:
        batch = self._batch
        return len(self._token_ids) if batch is None else batch.num_tokens[self._slot]

    @property
    def num_scheduled_tokens(self) -> int:
        """Known tokens plus those a submitted step is still sampling (async scheduling)."""
        return self.num_tokens + self.num_pending_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        """Its output tokens, copied out of token_ids (which keeps them, after the prompt)."""
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def is_finished(self) -> bool:
        return self.status is _FINISHED

    @property
    def in_decode(self) -> bool:
        """All tokens but the newest are in the cache: the next step feeds one token."""
        total = self.num_scheduled_tokens
        return total > self.num_prompt_tokens and self.num_computed_tokens >= total - 1

    @property
    def tbt_missed(self) -> bool:
        """A gap between its tokens already broke its TBT SLO: protecting it no longer pays."""
        return self.max_gap_s * 1000.0 > self.slo.tbt_ms

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def banned_token_ids(self) -> tuple[int, ...]:
        """Tokens the next sample may not be: EOS and stop tokens until `min_tokens` are out."""
        if self.num_output_tokens + self.num_pending_tokens >= self.sampling.min_tokens:
            return ()
        eos = () if self.sampling.ignore_eos else tuple(self.eos_token_ids)
        return eos + self.sampling.stop_token_ids

    def ends_after_pending(self) -> bool:
        """Its pending tokens reach max_tokens or the context length: it stops whatever they are."""
        return self.num_pending_tokens > 0 and self.num_scheduled_tokens >= self.length_limit

    def stop_reason(self) -> FinishReason | None:
        """Why the request must stop after its newest token, if it must (stop strings aside)."""
        num_output = self.num_output_tokens
        if not num_output:
            return None
        if num_output >= self.sampling.min_tokens and self.token_ids[-1] in self.stop_token_set:
            return FinishReason.STOP
        if self.num_tokens >= self.length_limit:
            return FinishReason.LENGTH
        return None
