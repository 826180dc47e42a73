"""Data-dependent branches inside a captured CUDA graph (conditional IF nodes).

A captured decode step replays the same kernels every step, so it cannot skip the selector when a
step would be cheaper dense. CUDA 12.4+ graphs hold conditional nodes: a body graph that runs only
when a device flag is true at replay. torch exposes them on `torch.cuda.CUDAGraph`
(`begin_capture_to_if_node` / `end_capture_to_conditional_node`, used by `torch.cond` under graph
capture and by vLLM). Rules the bodies must follow:

- Everything a body launches must have run once before capture (Triton compiles, FlashInfer module
  loads, cuBLAS handles): warm both branches eagerly first.
- A tensor the graph reads after the body must exist before it: bodies write into buffers made
  outside (`out.copy_(...)`), since the body's own allocations are private to it.
- No RNG inside a body.
"""

from __future__ import annotations

import contextlib

import torch


def conditional_nodes_supported() -> bool:
    """True where a captured graph can hold IF nodes: a CUDA device, a CUDA >= 12.4 build of torch
    (not ROCm) that exposes `CUDAGraph.begin_capture_to_if_node`."""
    if not torch.cuda.is_available() or torch.version.hip is not None or torch.version.cuda is None:
        return False
    major, minor = (int(x) for x in torch.version.cuda.split(".")[:2])
    return (major, minor) >= (12, 4) and hasattr(torch.cuda.CUDAGraph, "begin_capture_to_if_node")


def capturing() -> bool:
    """True while the current CUDA stream is being captured into a graph."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


@contextlib.contextmanager
def captured_if(flag: torch.Tensor):
    """Capture the block's kernels into an IF node of the graph being captured: at every replay they
    run only when `flag` (a 0-d bool CUDA tensor, read on the device at replay) is true.

    Only while capturing (`capturing()`); eagerly the caller branches on the host itself.
    """
    if flag.dim() != 0 or flag.dtype != torch.bool or not flag.is_cuda:
        raise ValueError(f"an IF node's flag must be a 0-d bool CUDA tensor, got {tuple(flag.shape)} {flag.dtype} "
                         f"on {flag.device}")
    graph = torch.cuda.CUDAGraph.get_currently_capturing_graph()
    graph.begin_capture_to_if_node(flag)
    try:
        yield
    finally:
        graph.end_capture_to_conditional_node()


class BranchFlags:
    """The pair of persistent device flags that picks one of two captured branches per replay.

    `set(first)` writes them with one asynchronous host-to-device copy from pinned memory (stream-
    ordered before the replay that reads them, no sync); `first` / `second` are the 0-d flags the IF
    nodes hold.
    """

    def __init__(self, device):
        self.device = torch.device(device)
        self._flags = torch.zeros(2, dtype=torch.bool, device=self.device)
        self.first, self.second = self._flags[0], self._flags[1]
        self.value = None  # the host's last choice

    def set(self, first: bool) -> None:
        """Choose the first branch (True) or the second (False) for the next replays."""
        host = torch.tensor([first, not first], dtype=torch.bool)
        if self.device.type == "cuda":
            host = host.pin_memory()  # a fresh pinned tensor: a pending copy never sees it rewritten
        self._flags.copy_(host, non_blocking=True)
        self.value = bool(first)
