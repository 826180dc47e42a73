"""The one device the Triton kernel tests (tests/ops, tests/training/test_gated_attention.py)
build their inputs on: CUDA where available, so the kernels compile and run on the GPU against
the torch references on the same data; else CPU, where tests/conftest.py has set
TRITON_INTERPRET=1 so the same kernels run in the interpreter."""

from __future__ import annotations

import pytest
import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(autouse=True)
def _no_tf32():
    """On CUDA, TF32 must not loosen the fp32 references the kernels are compared with.

    Imported by the conftests of the kernel test folders, so it applies there only, per test."""
    if DEVICE.type != "cuda":
        yield
        return
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
