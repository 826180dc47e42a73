"""Gate scoring for training: log g over exactly the previous blocks, the Top-K threshold, gradients."""

from __future__ import annotations

import math

import pytest
import torch

from sas_backend.gate.module import AttnGate
from sas_backend.ops.rope import rope_cos_sin_table
from sas_backend.training.scoring import BlockLogGate, score_gate

H_Q, H_KV, D, DG, B = 4, 2, 16, 32, 16
LENS = [70, 37, 16, 9, 50]  # partial last blocks, a one-block and a sub-block sequence


def _setup(seed=0, lens=LENS):
    g = torch.Generator().manual_seed(seed)
    gate = AttnGate(H_KV, H_Q // H_KV, D, DG)
    gate.reset_parameters(generator=g)
    t = sum(lens)
    q = torch.randn(t, H_Q, D, generator=g)
    k = torch.randn(t, H_KV, D, generator=g)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    table = rope_cos_sin_table(DG, 256, 10000.0)
    return gate, q, k, cu, table


def _reference_scores(gate, q, k, cu, table):
    """Per sequence and own block: s[h, t, m] for m < own block from AttnGate.query / summarize."""
    nb = math.ceil(max(LENS) / B)
    out = []
    for bos, eos in zip(cu[:-1].tolist(), cu[1:].tolist()):
        n = eos - bos
        qg = gate.query(q[bos:eos], table[:n])  # [n, Hkv, Dg]
        full = n // B
        kg = gate.summarize(k[bos:bos + full * B].reshape(full, B, H_KV, D), table[torch.arange(full) * B])
        rows = torch.full((H_KV, n, nb), float("-inf"))
        for c in range(1, math.ceil(n / B)):  # queries of own block c see blocks 0..c-1
            s = torch.einsum("phd,mhd->hpm", qg[c * B:(c + 1) * B], kg[:c]) / math.sqrt(DG)
            rows[:, c * B:(c + 1) * B, :c] = torch.log_softmax(s, dim=-1)
        out.append(rows)
    return torch.cat(out, 1)  # [Hkv, T, NB]


def test_log_g_is_log_softmax_over_previous_blocks():
    gate, q, k, cu, table = _setup()
    sc = score_gate(gate, q, k, cu, B, top_k=2, gate_table=table)
    ref = _reference_scores(gate, q, k, cu, table)
    assert sc.log_g.shape == ref.shape == (H_KV, q.shape[0], math.ceil(max(LENS) / B))
    finite = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(sc.log_g), finite)  # exactly the previous blocks
    torch.testing.assert_close(sc.log_g[finite], ref[finite], rtol=1e-5, atol=1e-5)
    # a distribution over the previous blocks wherever there is one
    has_prev = finite.any(-1)
    sums = sc.log_g.exp().sum(-1)
    torch.testing.assert_close(sums[has_prev], torch.ones_like(sums[has_prev]))
    assert (sums[~has_prev] == 0).all()


@pytest.mark.parametrize("top_k", [0, 1, 3, 10])
def test_threshold_picks_exactly_k(top_k):
    gate, q, k, cu, table = _setup(seed=1)
    sc = score_gate(gate, q, k, cu, B, top_k=top_k, gate_table=table)
    n_prev = torch.isfinite(sc.log_g).sum(-1)  # [Hkv, T] previous blocks per query
    chosen = (torch.isfinite(sc.log_g) & (sc.log_g >= sc.threshold[..., None])).sum(-1)
    torch.testing.assert_close(chosen, n_prev.clamp(max=top_k))
    few = n_prev < top_k
    assert torch.isneginf(sc.threshold[few]).all()  # fewer than K: everything is taken
    if top_k == 0:
        assert torch.isposinf(sc.threshold).all()
    else:
        assert torch.isfinite(sc.threshold[~few]).all()
    assert not sc.threshold.requires_grad


def test_query_chunking_does_not_change_results_or_grads():
    gate, q, k, cu, table = _setup(seed=2)
    res = []
    for chunk in (5, 4096):
        gate.zero_grad()
        sc = score_gate(gate, q, k, cu, B, top_k=2, gate_table=table, query_chunk=chunk)
        (sc.log_g.masked_fill(~torch.isfinite(sc.log_g), 0)
         * torch.linspace(-1, 1, sc.log_g.numel()).view_as(sc.log_g)).sum().backward()
        res.append((sc.log_g.detach(), sc.threshold, [p.grad.clone() for p in gate.parameters()]))
    torch.testing.assert_close(res[0][0], res[1][0])
    torch.testing.assert_close(res[0][1], res[1][1])
    for a, b in zip(res[0][2], res[1][2]):
        torch.testing.assert_close(a, b)


def test_block_log_gate_gradcheck():
    """The memory-bounded backward equals autograd's derivative (float64 gradcheck)."""
    g = torch.Generator().manual_seed(3)
    bounds = [(0, 13), (13, 20)]  # block 4: a partial block in each sequence
    qg = torch.randn(20, 2, 3, generator=g, dtype=torch.float64, requires_grad=True)
    kg = torch.randn(2, 4, 2, 3, generator=g, dtype=torch.float64, requires_grad=True)

    def fn(qg, kg):
        lg, _ = BlockLogGate.apply(qg, kg, bounds, 4, 2, 5)
        return torch.where(torch.isfinite(lg), lg, torch.zeros_like(lg))

    assert torch.autograd.gradcheck(fn, (qg, kg), eps=1e-6, atol=1e-6)


def test_gradients_reach_gate_only():
    gate, q, k, cu, table = _setup(seed=4)
    q.requires_grad_(True)
    k.requires_grad_(True)
    sc = score_gate(gate, q, k, cu, B, top_k=2, gate_table=table)
    sc.log_g.masked_fill(~torch.isfinite(sc.log_g), 0).square().sum().backward()
    assert q.grad is None and k.grad is None  # backbone inputs are detached
    for name, p in gate.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("start", [5, 16, 40])
def test_query_start_equals_the_whole_rows_sliced(start):
    """Queries from position `start` on (after a dense prefix): the same log g, threshold and gate
    gradients as those rows of the whole-row scoring (sequences shorter than `start` have none)."""
    gate, q, k, cu, table = _setup()
    bounds = list(zip(cu[:-1].tolist(), cu[1:].tolist()))
    rows = torch.cat([torch.arange(bos + start, eos) for bos, eos in bounds if eos - bos > start])
    full = score_gate(gate, q, k, cu, B, top_k=2, gate_table=table, query_chunk=7)
    tail = score_gate(gate, q[rows], k, cu, B, top_k=2, gate_table=table, query_chunk=7, query_start=start)
    torch.testing.assert_close(tail.log_g, full.log_g[:, rows])
    torch.testing.assert_close(tail.threshold, full.threshold[:, rows])
    w = torch.randn(tail.log_g.shape, generator=torch.Generator().manual_seed(3))
    grads = []
    for lg in (full.log_g[:, rows], tail.log_g):
        gate.zero_grad()
        (lg.masked_fill(lg.isinf(), 0) * w).sum().backward()
        grads.append([p.grad.clone() for p in gate.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_query_start_checks_the_query_count():
    gate, q, k, cu, table = _setup()
    with pytest.raises(ValueError, match="expected"):
        score_gate(gate, q, k, cu, B, top_k=2, gate_table=table, query_start=16)


@pytest.mark.parametrize("sink,local,top_k", [(1, 1, 3), (0, 2, 3), (2, 0, 4), (1, 1, 10)])
def test_forced_blocks_select_what_the_server_selects(sink, local, top_k):
    """With sink/local blocks forced in, the training selection {m < c : log_g >= threshold} is
    exactly the server's `select_blocks` on the raw gate scores (forced blocks inside K, the rest
    by score); forced blocks carry log g 0 (unbiased) and the others a distribution over themselves."""
    from sas_backend.ops.topk.naive import select_blocks

    lens = [200, 130, 64, 9]
    gate, q, k, cu, table = _setup(seed=5, lens=lens)
    sc = score_gate(gate, q, k, cu, B, top_k=top_k, gate_table=table, sink_blocks=sink, local_blocks=local)
    free = score_gate(gate, q, k, cu, B, top_k=top_k, gate_table=table)
    prev = torch.isfinite(free.log_g)  # every previous block, forced or not
    assert torch.equal(torch.isfinite(sc.log_g), prev)
    chosen = prev & (sc.log_g >= sc.threshold[..., None])  # [Hkv, T, NB]
    pos = torch.cat([torch.arange(n) for n in lens])
    own = pos // B
    want = select_blocks(free.log_g.transpose(0, 1), own, top_k, sink, local)  # [T, Hkv, K] (log_g ranks as s)
    nb = sc.log_g.shape[-1]
    want_mask = torch.zeros(pos.shape[0], H_KV, nb + 1, dtype=torch.bool)
    want_mask.scatter_(2, torch.where(want < 0, nb, want).long(), True)
    assert torch.equal(chosen, want_mask[..., :nb].transpose(0, 1))
    blk = torch.arange(nb)
    forced = ((blk[None, :] < sink) | (blk[None, :] >= own[:, None] - local)) & (blk[None, :] < own[:, None])
    assert (sc.log_g[:, forced] == 0).all()
    cand = prev & ~forced[None]
    sums = torch.where(cand, sc.log_g.exp(), torch.zeros(())).sum(-1)
    has = cand.any(-1)
    torch.testing.assert_close(sums[has], torch.ones_like(sums[has]))


def test_forced_blocks_gradcheck_and_no_gradient_on_them():
    g = torch.Generator().manual_seed(6)
    bounds = [(0, 29), (29, 41)]
    qg = torch.randn(41, 2, 3, generator=g, dtype=torch.float64, requires_grad=True)
    kg = torch.randn(2, 7, 2, 3, generator=g, dtype=torch.float64, requires_grad=True)

    def fn(qg, kg):
        lg, _ = BlockLogGate.apply(qg, kg, bounds, 4, 4, 5, 0, 1, 1)
        return torch.where(torch.isfinite(lg), lg, torch.zeros_like(lg))

    assert torch.autograd.gradcheck(fn, (qg, kg), eps=1e-6, atol=1e-6)
    # a loss on the forced entries only (block 0 and the block before the own) moves nothing
    lg, _ = BlockLogGate.apply(qg, kg, bounds, 4, 4, 5, 0, 1, 1)
    own = torch.cat([torch.arange(29), torch.arange(12)]) // 4
    forced = torch.zeros(41, 7, dtype=torch.bool)
    forced[own > 0, 0] = True
    forced[own > 0, (own - 1).clamp(min=0)[own > 0]] = True
    (lg[:, forced] * 3.0).sum().backward()
    assert qg.grad.abs().max() == 0 and kg.grad.abs().max() == 0


def test_forced_blocks_must_leave_the_gate_a_choice():
    gate, q, k, cu, table = _setup()
    with pytest.raises(ValueError, match="sink \\+ local < K"):
        score_gate(gate, q, k, cu, B, top_k=2, gate_table=table, sink_blocks=1, local_blocks=1)
    with pytest.raises(ValueError, match=">= 0"):
        score_gate(gate, q, k, cu, B, top_k=4, gate_table=table, sink_blocks=-1)


# ---------------------------------------------------------------- sub-block run summaries (issue 63)
def _runs_statement(qg, kg, bounds, block_size, sink=0, local=0):
    """log_g of n run summaries a block stated with plain autograd ops: a block's score is the max over its runs
    of qg . kg_run / sqrt(Dg), log-softmax over the candidate blocks (previous, not forced), 0 on forced ones."""
    from sas_backend.training.scoring import candidate_blocks

    t, h, dg = qg.shape
    nb = kg.shape[1]
    out = torch.full((h, t, nb), float("-inf"), dtype=qg.dtype)
    for i, (bos, eos) in enumerate(bounds):
        s = torch.einsum("chd,mhnd->hcmn", qg[bos:eos], kg[i]).amax(-1) / math.sqrt(dg)
        cand, forced = candidate_blocks(torch.arange(eos - bos), nb, block_size, sink, local)
        lg = torch.log_softmax(s.masked_fill(~cand, float("-inf")), dim=-1)
        lg = torch.where(cand, lg, torch.full_like(lg, float("-inf")))
        out[:, bos:eos] = torch.where(forced, torch.zeros_like(lg), lg)
    return out


@pytest.mark.parametrize("sink,local", [(0, 0), (1, 1)])
def test_block_log_gate_best_run_matches_the_statement_and_its_gradients(sink, local):
    """kg `[N, NB, Hkv, n, Dg]`: each block scores its best run (the server's --sas-sub-blocks rule); forward and
    the memory-bounded backward equal autograd through the plain statement (max over runs, log-softmax)."""
    g = torch.Generator().manual_seed(7)
    bounds = [(0, 29), (29, 45)]
    qg = torch.randn(45, 2, 8, generator=g, dtype=torch.float64, requires_grad=True)
    kg = torch.randn(2, 8, 2, 4, 8, generator=g, dtype=torch.float64, requires_grad=True)
    got, _ = BlockLogGate.apply(qg, kg, bounds, 4, 5, 7, 0, sink, local)
    want = _runs_statement(qg, kg, bounds, 4, sink, local)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    fin = torch.isfinite(want)
    torch.testing.assert_close(got[fin], want[fin])
    w = torch.randn(want.shape, generator=g, dtype=torch.float64)
    gq, gk = torch.autograd.grad((torch.where(fin, got, 0) * w).sum(), (qg, kg))
    wq, wk = torch.autograd.grad((torch.where(fin, want, 0) * w).sum(), (qg, kg))
    torch.testing.assert_close(gq, wq, rtol=1e-4, atol=1e-6)  # the backward's softmax runs in fp32
    torch.testing.assert_close(gk, wk, rtol=1e-4, atol=1e-6)
    assert bool((gk.abs().sum(dim=(0, 2, 4)) > 0).sum() < gk[0, :, 0].numel())  # only best runs get gradient


def test_block_log_gate_one_run_equals_whole_blocks():
    """n = 1 run a block is today's rule: the 5-D path equals the 4-D one."""
    g = torch.Generator().manual_seed(8)
    bounds = [(0, 21)]
    qg = torch.randn(21, 2, 8, generator=g)
    kg = torch.randn(1, 6, 2, 8, generator=g)
    a, ta = BlockLogGate.apply(qg, kg, bounds, 4, 3, 5)
    b, tb = BlockLogGate.apply(qg, kg[:, :, :, None], bounds, 4, 3, 5)
    assert torch.equal(a, b) and torch.equal(ta, tb)
