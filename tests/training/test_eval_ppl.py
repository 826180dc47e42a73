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


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_kv_fp8_reads_rounded_keys_and_values(fp8):
    """--kv-fp8: dense attention over the fp8-rounded K/V differs from dense (the rounding is real) and equals a
    covering-budget gate over the same rounding (sparse-fp8 vs dense-fp8, as the harness compares them); a sparse
    gate with fp8 reads differs from the one without."""
    model = tiny_llama()
    ids = torch.randint(0, 256, (WINDOW + 1,), generator=torch.Generator().manual_seed(2))
    cache = prefix_cache(model, ids, LAST)
    dense = window_nll(model, ids, LAST, None, cache)
    dense8 = window_nll(model, ids, LAST, SparseEvalSpec(top_k=1, block_size=B, selector="dense", kv_fp8=fp8), cache)
    assert abs(dense8 - dense) > 1e-4
    covering = SparseEvalSpec(top_k=WINDOW // B, block_size=B, selector="gate", gates=_gates(),
                              sparse_from=WINDOW - LAST, kv_fp8=fp8)
    assert window_nll(model, ids, LAST, covering, cache) == pytest.approx(dense8, rel=1e-6)
    sparse = dict(top_k=2, block_size=B, selector="gate", gates=_gates(), sparse_from=WINDOW - LAST)
    assert abs(window_nll(model, ids, LAST, SparseEvalSpec(**sparse, kv_fp8=fp8), cache)
               - window_nll(model, ids, LAST, SparseEvalSpec(**sparse), cache)) > 1e-4
    with pytest.raises(ValueError, match="kv_fp8"):
        SparseEvalSpec(top_k=1, kv_fp8=torch.bfloat16)
