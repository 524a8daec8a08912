"""StepPlan: everything the runner needs for one model step, and nothing it has to decide."""

from __future__ import annotations

from dataclasses import dataclass, field

from superinfer.engine.core.request import SamplingParams

# A token the step in flight is still sampling: the runner feeds that step's result in its place.
PLACEHOLDER = -1


@dataclass(slots=True)
class ScheduledSeq:
    """One request's share of a step: feed `token_ids` at positions start_pos.. .

    With async scheduling the last token id may be PLACEHOLDER: the token the previous step
    samples for this request.
    """

    request_id: str
    token_ids: list[int]
    start_pos: int
    block_ids: list[int]  # the request's whole GPU block table after this step's allocation
    sample: bool  # the chunk reaches the request's newest token: sample the next one
    sampling: SamplingParams
    banned_token_ids: tuple[int, ...] = ()  # not to be sampled yet (EOS and stop tokens before min_tokens)
    prompt_token_ids: list[int] | tuple[()] = ()  # the request's prompt (shared, not copied)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def context_len(self) -> int:
        return self.start_pos + len(self.token_ids)


@dataclass(frozen=True)
class StepPlan:
    step_id: int
    seqs: list[ScheduledSeq]
    # Block copies between tiers, (src, dst) pairs; executed before the model step reads them.
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # GPU block -> CPU block
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # CPU block -> GPU block
    # The unfinished steps this step's ops must wait for (0: none). Copy-out: the compute that wrote
    # its source blocks. Copy-in: a compute that still touches a destination block, and the copies
    # of a step that touch a source or destination. Compute: the copies of a step that touch a
    # block it writes (a block released under a copy and reused at once).
    swap_out_after: int = 0
    swap_in_after: int = 0
    swap_in_after_copy: int = 0
    compute_after_copy: int = 0
    # Requests that ended since the last plan: the runner drops any per-request state.
    released: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)

    @property
    def is_empty(self) -> bool:
        return not self.seqs and not self.swap_out and not self.swap_in
