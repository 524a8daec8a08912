"""ModelRunner: executes a StepPlan. Plan -> tensors -> forward -> sampled tokens.

It decides nothing: which tokens, blocks and sampling parameters come from the plan. One host
sync per step (reading the sampled tokens back).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from superinfer.engine.attention import AttentionMetadata, PagedAttention
from superinfer.engine.core.kv import cdiv
from superinfer.engine.core.plan import StepPlan
from superinfer.engine.duplex import CopyStats, DuplexKV
from superinfer.engine.sampling import sample


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # best alternatives, most likely first


@dataclass
class StepOutput:
    sampled: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)
    copies: CopyStats = field(default_factory=CopyStats)


@dataclass
class _StepInputs:
    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slot_blocks: list[int] = field(default_factory=list)
    slot_offsets: list[int] = field(default_factory=list)
    decode_rows: list[int] = field(default_factory=list)
    decode_tables: list[list[int]] = field(default_factory=list)
    decode_context: list[int] = field(default_factory=list)
    prefills: list[tuple[int, int, int, list[int]]] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)


def _gather_inputs(plan: StepPlan, block_size: int) -> _StepInputs:
    x = _StepInputs()
    row = 0
    for seq in plan.seqs:
        n, start, ctx = seq.num_tokens, seq.start_pos, seq.context_len
        x.input_ids.extend(seq.token_ids)
        x.positions.extend(range(start, ctx))
        for pos in range(start, ctx):
            x.slot_blocks.append(seq.block_ids[pos // block_size])
            x.slot_offsets.append(pos % block_size)
        table = seq.block_ids[: cdiv(ctx, block_size)]
        if n == 1:
            x.decode_rows.append(row)
            x.decode_tables.append(table)
            x.decode_context.append(ctx)
        else:
            x.prefills.append((row, n, ctx, table))
        row += n
        if seq.sample:
            x.sample_rows.append(row - 1)
    return x


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: torch.Tensor,
        block_size: int,
        scale: float,
        cpu_cache: torch.Tensor | None = None,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.duplex = DuplexKV(kv_cache, cpu_cache)
        self.block_size = block_size
        self.scale = scale
        self.device = kv_cache.device
        self.generators: dict[str, torch.Generator] = {}

    def _tensor(self, values: list[int]) -> torch.Tensor:
        t = torch.tensor(values, dtype=torch.long)
        if self.device.type == "cuda":
            return t.pin_memory().to(self.device, non_blocking=True)
        return t

    def _metadata(self, x: _StepInputs) -> AttentionMetadata:
        width = max((len(t) for t in x.decode_tables), default=0)
        padded = [t + [0] * (width - len(t)) for t in x.decode_tables]
        return AttentionMetadata(
            slot_blocks=self._tensor(x.slot_blocks),
            slot_offsets=self._tensor(x.slot_offsets),
            decode_rows=self._tensor(x.decode_rows),
            decode_tables=self._tensor(padded) if padded else self._tensor([]).view(0, 0),
            decode_context=self._tensor(x.decode_context),
            prefills=[(r, n, c, self._tensor(t)) for r, n, c, t in x.prefills],
        )

    def _generator(self, request_id: str, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        gen = self.generators.get(request_id)
        if gen is None:
            gen = self.generators[request_id] = torch.Generator(device=self.device).manual_seed(seed)
        return gen

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepOutput:
        """Run the plan's copies and model step; returns once both are complete."""
        for request_id in plan.released:
            self.generators.pop(request_id, None)
        self.duplex.start(plan.swap_out, plan.swap_in)
        out = self._forward(plan) if plan.seqs else StepOutput()
        out.copies = self.duplex.finish()
        return out

    def _forward(self, plan: StepPlan) -> StepOutput:
        x = _gather_inputs(plan, self.block_size)
        attn = PagedAttention(self.kv_cache, self._metadata(x), self.scale)
        hidden = self.model(self._tensor(x.input_ids), self._tensor(x.positions), attn)
        sampling = [s for s in plan.seqs if s.sample]
        if not sampling:
            return StepOutput()
        logits = self.model.compute_logits(hidden[self._tensor(x.sample_rows)])
        params = [s.sampling for s in sampling]
        gens = [self._generator(s.request_id, s.sampling.seed) for s in sampling]
        tokens, logprobs = sample(logits, params, gens, [s.banned_token_ids for s in sampling])

        ids = [s.request_id for s in sampling]
        out = StepOutput(sampled=dict(zip(ids, tokens.tolist(), strict=True)))
        if logprobs is not None:
            chosen = logprobs.chosen.tolist()
            top_ids, top_values = logprobs.top_ids.tolist(), logprobs.top_values.tolist()
            for i, (rid, p) in enumerate(zip(ids, params, strict=True)):
                if p.logprobs is not None:
                    top = list(zip(top_ids[i], top_values[i], strict=True))[: p.logprobs]
                    out.logprobs[rid] = TokenLogprob(out.sampled[rid], chosen[i], top)
        return out
