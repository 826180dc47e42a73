"""score_blocks_triton vs the plain-torch score_blocks (on DEVICE; TRITON_INTERPRET=1 on CPU)."""

import pytest
import torch

from sas_backend.ops.score.torch_path import score_blocks
from sas_backend.ops.score.triton import score_blocks_triton
from tests.devices import DEVICE


def _check(case, dg, q_dtype=torch.float32, s_dtype=torch.float32, max_blocks=None):
    bs, h = len(case.seq_lens), case.num_kv_heads
    gate_q = case.randn(bs, h, dg, dtype=q_dtype)
    summaries = case.randn(case.num_pages + 1, h, dg, dtype=s_dtype)
    max_blocks = case.max_blocks if max_blocks is None else max_blocks
    args = (gate_q, summaries, case.block_table(), case.num_candidates, case.block_size)
    args = args + (max_blocks,)
    ref = score_blocks(*args)
    out = score_blocks_triton(*args)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert torch.equal(torch.isinf(out), torch.isinf(ref))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    return out


@pytest.mark.parametrize("h_kv", [1, 2, 4])
@pytest.mark.parametrize("block_size", [4, 8])
def test_score_mixed_lengths(paged_case, h_kv, block_size):
    b = block_size
    # seq_len 1, exactly on a block boundary, one past it, partial, long
    case = paged_case([1, b, b + 1, 3 * b, 5 * b - 1, 9 * b + 2], b, h_kv, 16, seed=h_kv)
    _check(case, dg=16)


BF16_CASES = [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)]


@pytest.mark.parametrize("q_dtype,s_dtype", BF16_CASES)
def test_score_bf16(paged_case, q_dtype, s_dtype):
    case = paged_case([7, 33, 20], 4, 2, 32, seed=3)
    _check(case, dg=32, q_dtype=q_dtype, s_dtype=s_dtype)


def test_score_dg_not_power_of_two(paged_case):
    case = paged_case([13, 40], 4, 3, 24, seed=4)
    _check(case, dg=24)


def test_score_max_blocks_truncates(paged_case):
    # max_blocks below the candidate count: only the first max_blocks blocks are scored.
    case = paged_case([50, 9], 4, 2, 16, seed=5)
    out = _check(case, dg=16, max_blocks=5)
    assert torch.isfinite(out[0]).all()


def test_score_block_size_64(paged_case):
    case = paged_case([1, 64, 65, 200, 64 * 5], 64, 2, 32, seed=6)
    _check(case, dg=32)


def test_score_into_preallocated_out(paged_case):
    case = paged_case([17, 30], 4, 2, 16, seed=7)
    q = case.randn(2, 2, 16)
    summ = case.randn(case.num_pages + 1, 2, 16)
    args = (q, summ, case.block_table(), case.num_candidates, 4, case.max_blocks)
    out = torch.full((2, 2, case.max_blocks), 123.0, device=DEVICE)
    res = score_blocks_triton(*args, out=out)
    assert res is out
    torch.testing.assert_close(out, score_blocks(*args), rtol=1e-5, atol=1e-6)


def test_score_tiles_past_candidates_write_neg_inf(paged_case):
    # Several 64-block tiles per row; short rows leave whole tiles past their candidates (those
    # programs exit early) and those must still read -inf, also over a garbage-filled `out`.
    case = paged_case([1, 9, 300, 700], 4, 2, 16, seed=8)
    assert case.max_blocks > 128
    q = case.randn(4, 2, 16)
    summ = case.randn(case.num_pages + 1, 2, 16)
    args = (q, summ, case.block_table(), case.num_candidates, 4, case.max_blocks)
    out = torch.full((4, 2, case.max_blocks), 123.0, device=DEVICE)
    score_blocks_triton(*args, out=out)
    ref = score_blocks(*args)
    assert torch.equal(torch.isinf(out), torch.isinf(ref))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
