"""CUDA-graph capture for the GPU tests: a callable run once eagerly on a side stream (Triton compiles its kernels
and cuBLASLt builds its plans there: a capture must not), then captured."""

from __future__ import annotations

from collections.abc import Callable

import torch


def capture(fn: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """``fn()`` once on a side stream, ordered after the current stream's work and before its next, then captured
    into a new graph (the capture runs nothing: replay it)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph
