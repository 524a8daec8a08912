"""Linear layers on the CPU through oneDNN, with each weight reordered once into its blocked layout.

torch's `F.linear` on the CPU hands the row-major weight to MKL on every call, which at the row
counts of a decode step (a few to a few dozen tokens) reaches a fraction of what the same matmul
does over a weight already in the layout oneDNN's kernels read: measured on one AVX-512 core,
the tiny model's lm_head at 5 rows 215 -> 94 µs, at 64 rows 1.09 -> 0.92 ms, and the MLP alike
(whole steps: `bench.cpu_linear`). vLLM's CPU backend does the same. The dense weight stays
(loading, tied embeddings and the checkpoint names read it), so on the CPU float32 linear weights
take twice their size; `pack_linears` reports the bytes.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor, nn
from torch.nn import functional as F

log = logging.getLogger(__name__)

# The batch size the weight layout is chosen for: 16 and 64 measured alike from 5 to 300 rows.
PACK_FOR_ROWS = 64


class Linear(nn.Linear):
    """nn.Linear that runs on its oneDNN-packed weight once `pack_linears` gave it one."""

    packed: Tensor | None = None

    def forward(self, x: Tensor) -> Tensor:
        return self._project(x, self.bias)

    def matmul(self, x: Tensor) -> Tensor:
        """x @ weight.T, without the bias."""
        return self._project(x, None)

    def _project(self, x: Tensor, bias: Tensor | None) -> Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")
        return F.linear(x, self.weight, bias)


def why_not_packed(weight: Tensor) -> str | None:
    """Why this CPU weight keeps torch's matmul, or None when oneDNN can take it."""
    if weight.dtype != torch.float32:
        return f"{weight.dtype} weights stay on torch's matmul"
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return "this torch build has no oneDNN linear"
    return None


def pack_linears(model: nn.Module) -> int:
    """Give every `Linear` of a CPU float32 model its oneDNN-packed weight; returns the bytes added
    (0 when it keeps torch's matmul: silently off the CPU, else with the reason logged). Call after
    the weights are loaded."""
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    if not layers or layers[0].weight.device.type != "cpu":
        return 0
    problem = why_not_packed(layers[0].weight)
    if problem is None:
        try:
            packed = [torch.ops.mkldnn._reorder_linear_weight(m.weight.detach(), PACK_FOR_ROWS) for m in layers]
            probe = torch.randn(3, layers[0].in_features, generator=torch.Generator().manual_seed(0))
            got = torch.ops.mkldnn._linear_pointwise(probe, packed[0], None, "none", [], "")
            if not torch.allclose(got, F.linear(probe, layers[0].weight.detach()), rtol=1e-4, atol=1e-4):
                problem = "oneDNN's result differs from torch's on a probe"
        except RuntimeError as e:
            problem = f"oneDNN refused the weights ({e})"
    if problem is not None:
        log.info("linear layers: torch's matmul (%s)", problem)
        return 0
    for m, w in zip(layers, packed, strict=True):
        m.packed = w
    return sum(m.weight.numel() * m.weight.element_size() for m in layers)
