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


@dataclass(slots=True)
class DecodeRows:
    """Plain decodes in columns: row i feeds one token, token_ids[i] (or PLACEHOLDER), at
    start_pos[i] and samples the next, for a request without min_tokens (nothing banned). Every
    such row of a step is here, the other rows are ScheduledSeqs. Most of a step's requests at
    scale, so no object is built per row; `seqs()` builds them for tools and tests."""

    request_ids: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    start_pos: list[int] = field(default_factory=list)
    block_ids: list[list[int]] = field(default_factory=list)  # each request's whole GPU block table
    sampling: list[SamplingParams] = field(default_factory=list)
    prompt_token_ids: list[list[int] | tuple[()]] = field(default_factory=list)  # shared, not copied

    def __len__(self) -> int:
        return len(self.request_ids)

    def seqs(self) -> list[ScheduledSeq]:
        rows = zip(
            self.request_ids,
            self.token_ids,
            self.start_pos,
            self.block_ids,
            self.sampling,
            self.prompt_token_ids,
            strict=True,
        )
        return [
            ScheduledSeq(rid, [token], start, blocks, True, sp, (), prompt)
            for rid, token, start, blocks, sp, prompt in rows
        ]


@dataclass(frozen=True)
class StepPlan:
    step_id: int
    seqs: list[ScheduledSeq]  # prefill chunks, and decodes that need an entry of their own
    decodes: DecodeRows = field(default_factory=DecodeRows)
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
        return sum(s.num_tokens for s in self.seqs) + len(self.decodes)

    @property
    def num_context_tokens(self) -> int:
        """Tokens every request of the step attends to, its new ones included, in all."""
        return sum(s.context_len for s in self.seqs) + sum(self.decodes.start_pos) + len(self.decodes)

    @property
    def num_seqs(self) -> int:
        return len(self.seqs) + len(self.decodes)

    @property
    def is_empty(self) -> bool:
        return not self.seqs and not self.decodes and not self.swap_out and not self.swap_in

    def all_seqs(self) -> list[ScheduledSeq]:
        """Every request of the step as a ScheduledSeq, the decode rows last (for tools and tests:
        the runner and the scheduler read `seqs` and `decodes` as they are)."""
        return self.seqs + self.decodes.seqs()

    @property
    def num_sampled(self) -> int:
        """Tokens the step samples (the length of `sampled_ids()`)."""
        return sum(1 for s in self.seqs if s.sample) + len(self.decodes)

    def sampled_ids(self) -> list[str]:
        """The requests that sample a token in this step, in the runner's row order."""
        return [s.request_id for s in self.seqs if s.sample] + self.decodes.request_ids
