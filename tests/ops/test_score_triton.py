"""score_blocks_triton vs the plain-torch score_blocks (on DEVICE; TRITON_INTERPRET=1 on CPU)."""

import pytest
import torch

from sas_backend.ops.score import naive
from sas_backend.ops.score.torch_path import score_blocks
from sas_backend.ops.score.triton import score_blocks_triton
from tests.devices import DEVICE


def _check(case, dg, q_dtype=torch.float32, s_dtype=torch.float32, max_blocks=None, sub_blocks=1):
    bs, h = len(case.seq_lens), case.num_kv_heads
    gate_q = case.randn(bs, h, dg, dtype=q_dtype)
    summaries = case.randn(case.num_pages + 1, h, sub_blocks * dg, dtype=s_dtype)
    max_blocks = case.max_blocks if max_blocks is None else max_blocks
    args = (gate_q, summaries, case.block_table(), case.num_candidates, case.block_size)
    args = args + (max_blocks,)
    ref = score_blocks(*args, sub_blocks=sub_blocks)
    torch.testing.assert_close(ref, naive.score_blocks(*args, sub_blocks=sub_blocks), rtol=1e-5, atol=1e-6)  # stated
    out = score_blocks_triton(*args, sub_blocks=sub_blocks)
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


@pytest.mark.parametrize("sub_blocks,dg", [(2, 16), (4, 32), (4, 24)])
def test_score_sub_blocks(paged_case, sub_blocks, dg):
    """n run summaries a block (`[num_pages, H_kv, n * Dg]`): a block scores its best run, in the kernel as in the
    torch path, and both as the one-summary score of each run's columns, max over runs (the rule stated apart)."""
    case = paged_case([1, 8, 9, 23, 61], 4, 2, 16, seed=sub_blocks + dg)
    out = _check(case, dg, sub_blocks=sub_blocks)
    summaries = case.randn(case.num_pages + 1, 2, sub_blocks * dg)
    gate_q = case.randn(5, 2, dg)
    args = (case.block_table(), case.num_candidates, case.block_size, case.max_blocks)
    per_run = torch.stack([score_blocks(gate_q, summaries[..., j * dg:(j + 1) * dg], *args)
                           for j in range(sub_blocks)])
    torch.testing.assert_close(score_blocks(gate_q, summaries, *args, sub_blocks=sub_blocks), per_run.amax(dim=0))
    torch.testing.assert_close(score_blocks_triton(gate_q, summaries, *args, sub_blocks=sub_blocks),
                               per_run.amax(dim=0), rtol=1e-5, atol=1e-6)
    assert bool(torch.isfinite(out).any())


def test_score_sub_blocks_width_is_checked(paged_case):
    case = paged_case([9, 13], 4, 2, 16, seed=2)
    with pytest.raises(ValueError, match="do not match"):
        score_blocks_triton(case.randn(2, 2, 16), case.randn(case.num_pages + 1, 2, 16), case.block_table(),
                            case.num_candidates, 4, case.max_blocks, sub_blocks=2)
