"""Two levels with the second level's top-K inside the attend (`ops.rerank.candidate_lse` then
`ops.fused_step.attend(..., rank=)`): the attend's programs keep the blocks the plain statement of `ops.rerank` keeps
(written to `selected`), and attend exactly what the attend given that selection attends, bit for bit. Mixed lengths
(no candidate, fewer than K, between K and C, many), GQA 1-8 (3 and 7 included), fp32 / bf16 / fp8 keys, 4-bit key
codes, sink / local blocks, prompt anchors through the pool rows, one split and several, X = 2 and 4."""

import pytest
import torch

from sas_backend.ops import fused_step as fused
from sas_backend.ops.fused_step import naive as step_naive
from sas_backend.ops.rerank import RerankWorkspace, candidate_lse
from sas_backend.ops.rerank import naive
from tests.devices import DEVICE
from tests.ops.test_rerank import LENS, B, _case, _codes


def _run(lens, h_kv, g, k, factor, dtype, seed, target=64, anchors=0, sink=1, local=1, codes=False, d=32):
    args, m, pool, rows, want = _case(lens, h_kv, g, k, factor, dtype, seed=seed, sink=sink, local=local,
                                      anchors=anchors, d=d)
    key_codes = _codes(args) if codes else None
    pool_d = None if pool is None else pool.to(DEVICE)
    rows_d = None if pool is None else rows
    if codes:  # the statement over the decoded keys
        anchors_b = None if pool is None else pool[rows.long().cpu()]
        want = naive.rerank_blocks(args["q"].cpu(), args["k_buffer"].cpu(), args["first"].cpu(),
                                   args["block_table"].cpu(), args["num_candidates"].cpu(), k, m, args["scale"], B,
                                   sink, local, anchors_b, args["k_scale"], key_codes=key_codes)
    bs, c = len(lens), factor * k
    gen = torch.Generator().manual_seed(seed + 100)
    v = torch.randn(args["k_buffer"].shape, generator=gen)
    v_buffer = (v * 2).to(args["k_buffer"].dtype).to(DEVICE)
    seq_lens = torch.tensor(lens, device=DEVICE)
    rws = RerankWorkspace(bs, h_kv, g, c, DEVICE, ranked_rows=bs)
    geo = fused.StepGeometry(h_kv, g, d, d, 16, k, B)
    ws = fused.DecodeStepWorkspace(geo, bs, m + 1, DEVICE, target_programs=target)
    cands = candidate_lse(args["q"], args["k_buffer"], args["first"], args["block_table"], args["num_candidates"],
                          args["scale"], B, sink, local, pool_d, rows_d, args["k_scale"], rws, key_codes=key_codes)
    selected = torch.full((bs, h_kv, k), 99, dtype=torch.int32, device=DEVICE)
    out = fused.attend(ws, args["q"], args["k_buffer"], v_buffer, selected, args["block_table"], seq_lens,
                       args["scale"], k_scale=args["k_scale"], rank=cands)
    return dict(args=args, want=want, selected=selected, out=out, ws=ws, rws=rws, v=v_buffer, seq_lens=seq_lens,
                pool=pool, rows=rows)


def _check(run):
    args, want, ws = run["args"], run["want"], run["ws"]
    assert torch.equal(run["selected"].cpu(), want), f"\n{run['selected']}\n{want}"
    given = fused.attend(ws, args["q"], args["k_buffer"], run["v"], want.to(DEVICE), args["block_table"],
                         run["seq_lens"], args["scale"], k_scale=args["k_scale"])
    assert torch.equal(run["out"], given)  # the same kernel over the same blocks in the same order: the same floats
    ref = step_naive.attend(args["q"].float(), args["k_buffer"], run["v"], want.to(DEVICE), args["block_table"],
                            run["seq_lens"], B, args["scale"], args["k_scale"])
    tol = 1e-5 if args["q"].dtype == torch.float32 else 2e-2
    torch.testing.assert_close(run["out"].float(), ref.float(), rtol=tol, atol=tol)
    assert int(ws.attend_counters.abs().sum()) == 0 and int(run["rws"].counters.abs().sum()) == 0


@pytest.mark.parametrize("g", [1, 3, 4, 7, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attend_ranks_as_the_statement(g, dtype):
    _check(_run(LENS, 2, g, k=6, factor=2, dtype=dtype, seed=g))


@pytest.mark.parametrize("target", [1, 30, 200])
def test_one_split_and_several(target):
    """Every split ranks the same row and attends its share of the kept blocks (target 1: one split, no merge)."""
    run = _run(LENS, 2, 3, k=6, factor=2, dtype=torch.float32, seed=40 + target, target=target)
    assert (run["ws"].attend_splits(len(LENS)) == 1) == (target == 1)
    _check(run)


def test_four_times_k_candidates_anchors_and_fp8_keys():
    """X = 4 (C = 28, padded to 32: two RT chunks of the count), prompt anchors read through the pool rows (all kept),
    an fp8 cache holding K / k_scale."""
    run = _run(LENS, 2, 4, k=7, factor=4, dtype=torch.float8_e4m3fn, seed=5, anchors=2)
    _check(run)
    got = run["selected"].cpu()
    for r, n in enumerate(run["args"]["num_candidates"].tolist()):
        for h in range(2):
            assert {a for a in run["pool"][int(run["rows"][r]), h].tolist() if 0 <= a < n} <= set(got[r, h].tolist())


def test_budget_covering_every_candidate_and_no_forced_blocks():
    """Rows with at most K candidates keep them all in order; a row without candidates attends its current block."""
    run = _run([3 * B + 1, 6 * B, 2], 1, 7, k=8, factor=2, dtype=torch.bfloat16, seed=3, sink=0, local=0)
    _check(run)
    got = run["selected"].cpu()
    assert got[0, 0].tolist() == [0, 1, 2] + [-1] * 5 and got[2, 0].tolist() == [-1] * 8


@pytest.mark.parametrize("g,dtype", [(1, torch.float32), (7, torch.bfloat16)])
def test_keys_from_their_4bit_codes(g, dtype):
    _check(_run(LENS, 2, g, k=6, factor=2, dtype=dtype, seed=30 + g, anchors=2, codes=True))


def test_bad_rank_arguments_are_refused():
    run = _run([10 * B], 2, 2, k=4, factor=2, dtype=torch.float32, seed=1)
    args = run["args"]
    small = RerankWorkspace(1, 2, 2, 8, DEVICE)  # no ranked rows
    with pytest.raises(ValueError, match="ranked_rows"):
        candidate_lse(args["q"], args["k_buffer"], args["first"], args["block_table"], args["num_candidates"],
                      args["scale"], B, workspace=small)
    cands = candidate_lse(args["q"], args["k_buffer"], args["first"], args["block_table"], args["num_candidates"],
                          args["scale"], B, workspace=run["rws"])
    with pytest.raises(ValueError, match="rank.first"):
        fused.attend(run["ws"], args["q"], args["k_buffer"], run["v"], run["selected"], args["block_table"],
                     run["seq_lens"], args["scale"], rank=type(cands)(**{**vars(cands), "first": args["first"][:, :1]}))
