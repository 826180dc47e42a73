"""ops.anchors: the block mass of the last prompt query, its top blocks, and forcing them into a decode pick."""

from __future__ import annotations

import pytest
import torch

from sas_backend.hf.sparse_eval import oracle_scores
from sas_backend.ops.anchors import force_anchors, last_query_block_mass, top_anchors
from sas_backend.selection import SelectionRule, make_selector


@pytest.mark.parametrize("group", [1, 2, 3, 4, 7, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_mass_of_one_query_is_the_brute_force_statement(group, dtype):
    g = torch.Generator().manual_seed(group)
    h_kv, d, b, t = 2, 16, 8, 61  # a partial last block
    q = torch.randn(h_kv * group, d, generator=g).to(dtype)
    k = torch.randn(t, h_kv, d, generator=g).to(dtype)
    got = last_query_block_mass(q, k, 0.25, b)
    assert got.shape == (h_kv, t // b)
    for h in range(h_kv):
        for m in range(t // b):
            per_head = []
            for j in range(group):
                p = torch.softmax(k[:, h].float() @ q[h * group + j].float() * 0.25, dim=0)
                per_head.append(float(p[m * b:(m + 1) * b].sum()))
            assert float(got[h, m]) == pytest.approx(max(per_head), rel=1e-5, abs=1e-7)
    # the harness oracle ranks by the same rule
    logits = torch.einsum("hgd,thd->hgt", q.float().view(h_kv, group, d), k.float())[:, :, None] * 0.25
    torch.testing.assert_close(oracle_scores(logits, torch.tensor([t - 1]), b, t // b)[0], got)


def test_top_anchors_order_ties_and_padding():
    mass = torch.tensor([[0.1, 0.5, 0.5, 0.3, 0.9], [0.0, 0.0, 0.2, 0.0, 0.0]])
    assert top_anchors(mass, 4, 3).tolist() == [[1, 2, 3], [2, 0, 1]]  # block 4 is no candidate; ties: lower first
    assert top_anchors(mass, 2, 3).tolist() == [[1, 0, -1], [0, 1, -1]]
    assert top_anchors(mass, 0, 2).tolist() == [[-1, -1], [-1, -1]]
    assert top_anchors(mass, 5, 0).shape == (2, 0)


def test_force_anchors_raises_candidates_only():
    scores = torch.randn(3, 2, 10)
    anchors = torch.tensor([[7, 2, -1], [9, -1, -1]]).expand(3, -1, -1)
    n_cand = torch.tensor([10, 8, 3])
    got = force_anchors(scores, anchors, n_cand)
    for p, n in enumerate(n_cand.tolist()):
        for h, row in enumerate(anchors[0].tolist()):
            for m in range(10):
                want = float("inf") if (m in row and m < n) else float(scores[p, h, m])
                assert float(got[p, h, m]) == want
    big = force_anchors(scores, torch.full((3, 2, 1), 12), n_cand)  # out of range: ignored, not an error
    assert torch.equal(big, scores)


@pytest.mark.parametrize("selector", ["gate", "quest"])
def test_a_pick_takes_anchors_after_its_forced_blocks(selector):
    rule = SelectionRule(top_k=4, block_size=8, sink_blocks=1, local_blocks=1)
    sel = make_selector(selector, rule)
    anchors = torch.tensor([[[7, 2, -1], [5, -1, -1]]])
    chosen = sel.pick(force_anchors(torch.full((1, 2, 10), -5.0), anchors, torch.tensor([10])), torch.tensor([10]))
    assert set(chosen[0, 0].tolist()) == {0, 2, 7, 9}
    assert {0, 5, 9} <= set(chosen[0, 1].tolist())
