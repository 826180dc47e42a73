"""A CUDA graph, emulated on CPU: record the aten ops of a region once, replay only those.

What a captured CUDA graph keeps is the kernels and the addresses they read and write, never the
Python that launched them. This recorder keeps the same: during `capture()` every aten op is
logged with the very tensors it read and wrote; `replay()` re-runs those ops on those tensors and
writes each fresh result into the tensor recorded as that op's output (so later ops, which hold
the recorded tensors, see it). Python state set during warm-up or capture is frozen, as on a GPU.

Capture also refuses what a CUDA graph cannot hold: host syncs (`.item()`, `.tolist()`,
`bool(tensor)`) and ops whose output shape depends on tensor data (`nonzero`, boolean masks).
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
    def __init__(self, log):
        super().__init__()
        self.log = log

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
        self.log.append((func, args, kwargs, out))
        return out


def _aliases_input(func) -> bool:
    """Views, in-place and out= ops return (part of) an input: replaying them is the effect."""
    return any(r.alias_info is not None for r in func._schema.returns)


class CpuGraph:
    """capture() once, then replay() any number of times."""

    def __init__(self):
        self.log = []

    @contextlib.contextmanager
    def capture(self):
        with torch.no_grad(), _Recorder(self.log):
            yield self

    @torch.no_grad()
    def replay(self) -> None:
        for func, args, kwargs, out in self.log:
            fresh = func(*args, **kwargs)
            if _aliases_input(func):
                continue
            for kept, new in zip(tree_flatten(out)[0], tree_flatten(fresh)[0]):
                if isinstance(kept, torch.Tensor):
                    kept.copy_(new)
