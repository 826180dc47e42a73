"""build_kv_indices_triton vs the plain-torch build_kv_indices: indices must be identical."""

import pytest
import torch

from sas_backend.ops.gather.naive import build_kv_indices, kv_indptr_for
from sas_backend.ops.gather.triton import build_kv_indices_triton, build_kv_indptr_and_indices_triton
from sas_backend.ops.score.naive import candidate_counts
from sas_backend.ops.topk.naive import select_blocks
from tests.devices import DEVICE


def _selection(case, k, sink=0, local=0):
    bs, h = len(case.seq_lens), case.num_kv_heads
    scores = case.randn(bs, h, case.max_blocks)
    n_cand = candidate_counts(case.seq_lens, case.block_size)
    return select_blocks(scores, n_cand, k, sink, local)


def _check(case, selected):
    args = (selected, case.seq_lens, case.req_to_token, case.req_pool_indices, case.block_size)
    ref_ptr, ref_idx = build_kv_indices(*args)
    ptr, idx = build_kv_indptr_and_indices_triton(*args)
    assert torch.equal(ptr, ref_ptr)
    assert idx.dtype == torch.int32 and torch.equal(idx, ref_idx)
    return ref_ptr, ref_idx


@pytest.mark.parametrize("h_kv", [1, 3, 8])
@pytest.mark.parametrize("block_size,k", [(4, 3), (8, 2)])
def test_gather_mixed_lengths(paged_case, h_kv, block_size, k):
    b = block_size
    # seq_len 1; on a block boundary; partial current block; fewer, exactly, more than K candidates
    lens = [1, b, b + 1, 2 * b + 3, (k + 1) * b, (k + 1) * b + 1, 7 * b - 1]
    case = paged_case(lens, b, h_kv, 16, seed=h_kv + b)
    _check(case, _selection(case, k))


def test_gather_with_forced_blocks(paged_case):
    case = paged_case([40, 3, 17, 64], 4, 2, 16, seed=9)
    _check(case, _selection(case, 5, sink=1, local=2))


def test_gather_block_size_64(paged_case):
    case = paged_case([1, 64, 65, 64 * 4 + 10, 64 * 6], 64, 2, 16, seed=10)
    _check(case, _selection(case, 2))


def test_gather_fills_preallocated_buffer_only(paged_case):
    case = paged_case([9, 30, 1], 4, 2, 16, seed=11)
    sel = _selection(case, 3)
    ref_ptr, ref_idx = _check(case, sel)
    indptr = kv_indptr_for(case.seq_lens, 3, 4, 2)
    # a fixed-size CUDA-graph buffer
    buf = torch.full((ref_idx.numel() + 50,), -7, dtype=torch.int32, device=DEVICE)
    common = (case.seq_lens, case.req_to_token, case.req_pool_indices, 4)
    res = build_kv_indices_triton(sel, *common, indptr, buf)
    assert res is buf
    assert torch.equal(buf[: ref_idx.numel()], ref_idx)
    assert torch.all(buf[ref_idx.numel():] == -7)


def test_gather_k_zero_and_empty_rows(paged_case):
    case = paged_case([5, 12], 4, 2, 16, seed=12)
    sel = torch.full((2, 2, 0), -1, dtype=torch.int32, device=DEVICE)  # K = 0: current block only
    _check(case, sel)
    zero = paged_case([0, 6], 4, 1, 16, seed=13)  # seq_len 0: an empty row
    _check(zero, _selection(zero, 2))
