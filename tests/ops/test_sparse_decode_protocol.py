"""Both sparse-decode implementations follow `ops.sparse_decode.SparseDecode`: the same methods with the same
parameters (names, order, defaults), so the decode step drives either one alike. FlashInfer's is checked on its
class (it imports flashinfer only when built)."""

from __future__ import annotations

import inspect

import pytest
import torch

from sas_backend.ops.sparse_decode import SparseDecode, TorchSparseDecode, make_sparse_decode
from sas_backend.ops.sparse_decode.flashinfer import FlashInferSparseDecode


def _params(fn):
    return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize("impl", [TorchSparseDecode, FlashInferSparseDecode])
@pytest.mark.parametrize("method", ["plan", "run", "device_nbytes"])
def test_implementation_has_the_protocol_signature(impl, method):
    assert _params(getattr(impl, method)) == _params(getattr(SparseDecode, method)), (impl.__name__, method)


def test_cpu_factory_returns_a_sparse_decode():
    sd = make_sparse_decode("cpu", 2, 3, 16, 4, 8, 8, torch.float32, torch.float32)
    assert isinstance(sd, SparseDecode) and sd.device_nbytes() == 0
