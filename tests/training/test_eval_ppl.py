"""eval_ppl's shared dense prefix: running only the scored queries on a cached prefix gives the
same NLL as the whole window, for every selector, and leaves the cache reusable."""

from __future__ import annotations

import pytest
import torch

from sas_backend.gate.module import AttnGate
from sas_backend.hf.sparse_eval import SparseEvalSpec
from sas_backend.training.eval_ppl import prefix_cache, window_nll
from tiny_llama import tiny_llama

WINDOW, LAST, B = 96, 40, 16


def _gates(seed=0):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(2):
        gate = AttnGate(2, 2, 16, 32)
        gate.reset_parameters(generator=g)
        out[i] = gate
    return out


@pytest.mark.parametrize("selector", ["dense", "gate", "sink-local", "quest", "oracle", "random"])
def test_cached_prefix_equals_whole_window(selector):
    model = tiny_llama()
    ids = torch.randint(0, 256, (WINDOW + 1,), generator=torch.Generator().manual_seed(1))
    spec = None
    if selector == "gate":
        spec = SparseEvalSpec(top_k=2, block_size=B, selector="gate", gates=_gates(), sparse_from=WINDOW - LAST)
    elif selector != "dense":
        spec = SparseEvalSpec(top_k=2, block_size=B, selector=selector, sparse_from=WINDOW - LAST)
    whole = window_nll(model, ids, LAST, spec)
    cache = prefix_cache(model, ids, LAST)
    assert cache.get_seq_length() == WINDOW - LAST
    for _ in range(2):  # the cache is cropped back to the prefix after each use
        assert window_nll(model, ids, LAST, spec, cache) == pytest.approx(whole, rel=1e-5)
        assert cache.get_seq_length() == WINDOW - LAST
    if spec is not None:  # and sparsity changed the result (not silently dense)
        assert abs(whole - window_nll(model, ids, LAST)) > 1e-3
