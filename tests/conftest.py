"""Suite-wide: GPU tests (marker `gpu`) are skipped, with the reason, where CUDA is unavailable."""

from __future__ import annotations

import os

import pytest
import torch

# Without a GPU, Triton kernels run in the interpreter; Triton reads this when a kernel module is
# first imported, so it is set here, before any test module imports one.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (FlashInfer / compiled Triton / CUDA graphs)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
