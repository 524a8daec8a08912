"""The token history the penalties need, kept on the device for the live requests that use one.

Each such request owns a row of two [rows, vocab] tensors: how often it generated each token, and
which tokens its prompt holds. Rows are filled when the request first samples and counted on the
device right after each sample, so the next step's penalties never wait for the host (async
scheduling included). A request keeps its row across preemption and rotation until it ends.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from superinfer.engine.core.request import SamplingParams
from superinfer.engine.worker.device_tensor import device_tensor
from superinfer.engine.worker.sampling import TokenHistory


class TokenHistories:
    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size, self.device = vocab_size, device
        self.output_counts = torch.zeros((0, vocab_size), dtype=torch.int32, device=device)
        self.in_prompt = torch.zeros((0, vocab_size), dtype=torch.bool, device=device)
        self.row_of: dict[str, int] = {}
        self.free_rows: list[int] = []

    def _grow(self) -> None:
        n = len(self.output_counts)
        more = max(8, n)
        self.output_counts = torch.cat([self.output_counts, self.output_counts.new_zeros((more, self.vocab_size))])
        self.in_prompt = torch.cat([self.in_prompt, self.in_prompt.new_zeros((more, self.vocab_size))])
        self.free_rows.extend(range(n + more - 1, n - 1, -1))

    def _row(self, request_id: str, prompt_token_ids: Sequence[int]) -> int:
        row = self.row_of.get(request_id)
        if row is None:
            if not self.free_rows:
                self._grow()
            row = self.row_of[request_id] = self.free_rows.pop()
            self.output_counts[row].zero_()
            self.in_prompt[row].zero_()
            prompt = device_tensor(prompt_token_ids, torch.long, self.device)
            # index_fill_, not an index_put_ of True: that copies the True from the host (a sync)
            self.in_prompt[row].index_fill_(0, prompt, True)
        return row

    def rows(
        self, request_ids: Sequence[str], sampling: Sequence[SamplingParams], prompts: Sequence[Sequence[int]]
    ) -> torch.Tensor | None:
        """The history row of each sampled row (of the penalized ones; the others read a zero
        row), or None when none is penalized."""
        if not any(p.penalized for p in sampling):
            return None
        rows = [
            self._row(rid, prompt) if p.penalized else -1
            for rid, p, prompt in zip(request_ids, sampling, prompts, strict=True)
        ]
        return device_tensor(rows, torch.long, self.device)

    def gather(self, rows: torch.Tensor) -> TokenHistory:
        counts = self.output_counts[rows.clamp(min=0)]
        in_prompt = self.in_prompt[rows.clamp(min=0)]
        unused = (rows < 0)[:, None]
        return TokenHistory(counts.masked_fill(unused, 0), in_prompt.masked_fill(unused, False))

    def record(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """Count each penalized row's sampled token (rows of -1 are skipped), on the device."""
        counted = (rows >= 0).to(torch.int32)  # a skipped row adds 0 to row 0: no host sync for a mask
        self.output_counts.index_put_((rows.clamp(min=0), tokens), counted, accumulate=True)

    def release(self, request_id: str) -> None:
        row = self.row_of.pop(request_id, None)
        if row is not None:
            self.free_rows.append(row)
