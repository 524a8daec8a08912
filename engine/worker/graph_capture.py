"""Capturing CUDA graphs the way both the decode and the piecewise graphs do."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

T = TypeVar("T")


def capture(
    functions: Sequence[Callable[[], T]], device: torch.device, pool: Any = None
) -> tuple[list[torch.cuda.CUDAGraph], list[T], Any]:
    """Run `functions` once in order on a side stream (kernels compiled and library handles made
    outside any graph), then capture each into a graph of its own, in memory pool `pool` (None: a
    new one). Returns the graphs, what each function returned during its capture (its output
    buffers), and the pool for the next captures to share."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for fn in functions:
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graphs, outputs = [], []
    for fn in functions:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            outputs.append(fn())
        pool = graph.pool()
        graphs.append(graph)
    return graphs, outputs, pool
