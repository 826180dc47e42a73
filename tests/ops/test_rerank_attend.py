"""The second level and the attention in one pass, the torch path (`ops.rerank.rerank_attend`): it keeps the blocks
the plain statement of `ops.rerank` keeps, and attends what the plain sparse decode attends over those blocks plus the
current one. Mixed lengths (no candidate, fewer than K, between K and C, many), GQA 1-8 (3 and 7 included), fp32 /
bf16 / fp8 caches with their scales, sink / local blocks, prompt anchors through the pool rows, a first level cut
below K (a short row's eager step), X = 2 and 3."""

import pytest
import torch

from sas_backend.ops.fused_step import naive as step_naive
from sas_backend.ops.rerank import rerank_attend, rerank_blocks
from tests.devices import DEVICE
from tests.ops.test_rerank import LENS, B, _case


def _values(args, seed, v_scale=1.0):
    gen = torch.Generator().manual_seed(seed + 100)
    v = torch.randn(args["k_buffer"].shape, generator=gen) * 2
    return (v / v_scale).to(args["k_buffer"].dtype).to(DEVICE)


def _check(lens, h_kv, g, k, factor, dtype, seed, anchors=0, sink=1, local=1, v_scale=1.0):
    args, m, pool, rows, want = _case(lens, h_kv, g, k, factor, dtype, seed=seed, sink=sink, local=local,
                                      anchors=anchors)
    v_buffer = _values(args, seed, v_scale)
    seq_lens = torch.tensor(lens, device=DEVICE)
    out, kept = rerank_attend(args["q"], args["k_buffer"], v_buffer, args["first"], args["block_table"], seq_lens,
                              args["num_candidates"], k, m, args["scale"], B, sink, local,
                              None if pool is None else pool.to(DEVICE), None if pool is None else rows,
                              args["k_scale"], v_scale)
    assert kept.dtype == torch.int32 and torch.equal(kept.cpu(), want), f"\n{kept}\n{want}"
    ref = step_naive.attend(args["q"].float(), args["k_buffer"], v_buffer, want.to(DEVICE), args["block_table"],
                            seq_lens, B, args["scale"], args["k_scale"], v_scale)
    assert out.dtype == args["q"].dtype and out.shape == args["q"].shape
    tol = 1e-5 if args["q"].dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)
    return args, m, out


@pytest.mark.parametrize("g", [1, 3, 4, 7, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_keeps_the_statements_blocks_and_attends_them(g, dtype):
    _check(LENS, 2, g, k=6, factor=2, dtype=dtype, seed=g)


def test_fp8_cache_with_its_scales_and_anchors_from_the_pool_rows():
    """An fp8 cache holds K / k_scale and V / v_scale; anchors come through the batch's pool rows (X = 3)."""
    _check(LENS, 2, 4, k=5, factor=3, dtype=torch.float8_e4m3fn, seed=5, anchors=2, v_scale=0.25)


def test_no_forced_blocks_and_rows_covered_by_the_budget():
    """Rows with at most K candidates keep them all, a row with none attends its current block alone."""
    args, m, out = _check([3 * B + 1, 6 * B, 2], 1, 7, k=8, factor=2, dtype=torch.float32, seed=3, sink=0, local=0)
    assert torch.isfinite(out).all()  # the 2-token row's softmax has its current block's tokens, never none


def test_a_first_level_cut_below_k():
    """The eager step cuts the first level to the plan's widest row (columns past it all -1), below K: every
    candidate kept, the selection padded to K."""
    lens = [4 * B + 3, 2 * B, 1]
    args, m, _, _, want = _case(lens, 2, 3, k=6, factor=2, dtype=torch.float32, seed=9)
    first = args["first"][..., :m - 2]  # the PagedCase plan leaves 2 spare blocks; no row has more candidates
    assert int((args["first"][..., m - 2:] >= 0).sum()) == 0
    v_buffer = _values(args, 9)
    seq_lens = torch.tensor(lens, device=DEVICE)
    out, kept = rerank_attend(args["q"], args["k_buffer"], v_buffer, first, args["block_table"], seq_lens,
                              args["num_candidates"], 6, m, args["scale"], B, 1, 1)
    assert kept.shape == (3, 2, 6) and torch.equal(kept.cpu(), want)
    ref = step_naive.attend(args["q"], args["k_buffer"], v_buffer, want.to(DEVICE), args["block_table"], seq_lens, B,
                            args["scale"])
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_same_blocks_as_the_second_level_alone():
    """The one-pass path keeps what `rerank_blocks` keeps (the served two-pass path on CPU)."""
    args, m, pool, rows, _ = _case(LENS, 3, 2, k=5, factor=2, dtype=torch.bfloat16, seed=11, anchors=1)
    v_buffer = _values(args, 11)
    alone = rerank_blocks(**args, max_blocks=m, anchors=pool.to(DEVICE), anchor_rows=rows)
    _, kept = rerank_attend(args["q"], args["k_buffer"], v_buffer, args["first"], args["block_table"],
                            torch.tensor(LENS, device=DEVICE), args["num_candidates"], 5, m, args["scale"], B, 1, 1,
                            pool.to(DEVICE), rows, args["k_scale"])
    assert torch.equal(kept, alone)


def test_bad_arguments_are_refused():
    args, m, _, _, _ = _case([10 * B], 2, 2, k=4, factor=2, dtype=torch.float32)
    v_buffer = _values(args, 0)
    seq = torch.tensor([10 * B], device=DEVICE)
    base = (args["first"], args["block_table"], seq, args["num_candidates"])
    with pytest.raises(ValueError, match="K = 0"):
        rerank_attend(args["q"], args["k_buffer"], v_buffer, *base, 0, m, args["scale"], B)
    with pytest.raises(ValueError, match="disagree"):
        rerank_attend(args["q"], args["k_buffer"], v_buffer[:-1], *base, 4, m, args["scale"], B)


def test_no_candidate_columns_at_all():
    """A first level cut to no columns (every row shorter than a block past its current one) attends the current
    block alone and keeps nothing."""
    lens = [B - 3, 5]
    args, m, _, _, _ = _case(lens, 2, 3, k=4, factor=2, dtype=torch.float32, seed=13)
    v_buffer = _values(args, 13)
    seq_lens = torch.tensor(lens, device=DEVICE)
    out, kept = rerank_attend(args["q"], args["k_buffer"], v_buffer, args["first"][..., :0], args["block_table"],
                              seq_lens, args["num_candidates"], 4, m, args["scale"], B)
    assert kept.shape == (2, 2, 4) and int((kept >= 0).sum()) == 0
    ref = step_naive.attend(args["q"], args["k_buffer"], v_buffer, kept, args["block_table"], seq_lens, B,
                            args["scale"])
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
