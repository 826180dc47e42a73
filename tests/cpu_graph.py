"""A CUDA graph, emulated on CPU: record the aten ops of a region once, replay only those.

What a captured CUDA graph keeps is the kernels and the addresses they read and write, never the
Python that launched them. This recorder keeps the same: during `capture()` every aten op is
logged with the very tensors it read and wrote; `replay()` re-runs those ops on those tensors and
writes each fresh result into the tensor recorded as that op's output (so later ops, which hold
the recorded tensors, see it). Python state set during warm-up or capture is frozen, as on a GPU.

Capture also refuses what a CUDA graph cannot hold: host syncs (`.item()`, `.tolist()`,
`bool(tensor)`) and ops whose output shape depends on tensor data (`nonzero`, boolean masks).

Conditional IF nodes (`sas_backend.backend.graph_branch`): ops captured inside `if_body(flag)` replay
only when the 0-d bool `flag` holds true at replay. `CpuGraph.current` is the graph being captured
(None outside a capture), for stand-ins of `graph_branch.capturing` / `captured_if`.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

_HOST_SYNC = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2", "item"}


class GraphCaptureError(RuntimeError):
    """The captured region did something a CUDA graph cannot replay."""


class _Recorder(TorchDispatchMode):
    def __init__(self, graph):
        super().__init__()
        self.graph = graph

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in _HOST_SYNC:
            raise GraphCaptureError(f"host sync or data-dependent shape inside a captured region: aten.{name}")
        if name == "index" and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in tree_flatten(args[1:])[0]
        ):
            raise GraphCaptureError("boolean-mask indexing (data-dependent shape) inside a captured region")
        out = func(*args, **kwargs)
        self.graph.log.append((func, args, kwargs, out, self.graph._flag))
        return out


def _aliases_input(func) -> bool:
    """Views, in-place and out= ops return (part of) an input: replaying them is the effect."""
    return any(r.alias_info is not None for r in func._schema.returns)


class CpuGraph:
    """capture() once, then replay() any number of times."""

    current = None  # the graph being captured

    def __init__(self):
        self.log = []
        self._flag = None  # the IF body being captured: its flag

    @contextlib.contextmanager
    def capture(self):
        CpuGraph.current = self
        try:
            with torch.no_grad(), _Recorder(self):
                yield self
        finally:
            CpuGraph.current = None

    @contextlib.contextmanager
    def if_body(self, flag: torch.Tensor):
        """Ops captured in this block replay only while `flag` (0-d bool) is true."""
        if flag.dim() != 0 or flag.dtype != torch.bool:
            raise GraphCaptureError(f"an IF node's flag must be a 0-d bool tensor, got {flag.shape} {flag.dtype}")
        if self._flag is not None:
            raise GraphCaptureError("nested IF bodies are not emulated")
        self._flag = flag
        try:
            yield
        finally:
            self._flag = None

    @torch.no_grad()
    def replay(self) -> None:
        for func, args, kwargs, out, flag in self.log:
            if flag is not None and not bool(flag):
                continue
            fresh = func(*args, **kwargs)
            if _aliases_input(func):
                continue
            for kept, new in zip(tree_flatten(out)[0], tree_flatten(fresh)[0]):
                if isinstance(kept, torch.Tensor):
                    kept.copy_(new)
