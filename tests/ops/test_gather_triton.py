"""build_kv_indices_triton vs the plain-torch build_kv_indices: indices must be identical, and each
row must list exactly the req_to_token slots of its blocks' positions (checked independently)."""

import pytest
import torch

from sas_backend.ops.gather.torch_path import build_kv_indices, kv_indptr_for
from sas_backend.ops.gather.triton import build_kv_indices_triton
from sas_backend.ops.score.torch_path import candidate_counts
from sas_backend.ops.topk.naive import select_blocks
from tests.devices import DEVICE


def _selection(case, k, sink=0, local=0):
    bs, h = len(case.seq_lens), case.num_kv_heads
    scores = case.randn(bs, h, case.max_blocks)
    n_cand = candidate_counts(case.seq_lens, case.block_size)
    return select_blocks(scores, n_cand, k, sink, local)


def _check(case, selected):
    b, (bs, h_kv, k) = case.block_size, selected.shape
    ptr = kv_indptr_for(case.seq_lens, k, b, h_kv)
    n = int(ptr[-1])
    args = (selected, case.block_table(), case.seq_lens, b, ptr)
    ref_idx = build_kv_indices(*args, torch.zeros(n, dtype=torch.int32, device=DEVICE))
    idx = build_kv_indices_triton(*args, torch.full((n,), -1, dtype=torch.int32, device=DEVICE))
    assert idx.dtype == torch.int32 and torch.equal(idx, ref_idx)
    for r in range(bs):  # the semantics, from req_to_token directly
        seq = int(case.seq_lens[r])
        cur = max(seq - 1, 0) // b
        slots_of = case.req_to_token[int(case.req_pool_indices[r])].long()
        for h in range(h_kv):
            blocks = [int(m) for m in selected[r, h] if m >= 0]
            pos = [m * b + o for m in blocks for o in range(b)] + list(range(cur * b, seq))
            want = (slots_of[pos] * h_kv + h).tolist() if pos else []
            assert idx[ptr[r * h_kv + h] : ptr[r * h_kv + h + 1]].tolist() == want
    return ptr, ref_idx


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
    res = build_kv_indices_triton(sel, case.block_table(), case.seq_lens, 4, indptr, buf)
    assert res is buf
    assert torch.equal(buf[: ref_idx.numel()], ref_idx)
    assert torch.all(buf[ref_idx.numel():] == -7)


def test_gather_k_zero_and_empty_rows(paged_case):
    case = paged_case([5, 12], 4, 2, 16, seed=12)
    sel = torch.full((2, 2, 0), -1, dtype=torch.int32, device=DEVICE)  # K = 0: current block only
    _check(case, sel)
    zero = paged_case([0, 6], 4, 1, 16, seed=13)  # seq_len 0: an empty row
    _check(zero, _selection(zero, 2))
