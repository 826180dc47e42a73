"""Each op's naive.py, which depends on nothing but torch and states the rule in loops, against the batched
torch path the server runs (issue 62 item 5): quest's bounds and scores, prompt anchors, the KV index rows,
and Top-K's forced tiers, on random inputs and edge cases (no candidates, fewer candidates than K, GQA 1-7,
anchors out of range or repeated)."""

from __future__ import annotations

import pytest
import torch

from sas_backend.ops.anchors import naive as anchors_naive
from sas_backend.ops.anchors.torch_path import force_anchors
from sas_backend.ops.gather import naive as gather_naive
from sas_backend.ops.gather.torch_path import build_kv_indices, kv_indptr_for
from sas_backend.ops.quest import naive as quest_naive
from sas_backend.ops.quest.torch_path import key_bounds, quest_scores
from sas_backend.ops.topk import naive as topk_naive
from sas_backend.ops.topk.torch_path import forced_tier

B = 8


def _table(g, bs, m, pages=64):
    """`[bs, m + 1]` first slots of distinct random pages per request (page 0 is the padding page)."""
    return torch.stack([torch.randperm(pages - 1, generator=g)[: m + 1] + 1 for _ in range(bs)]) * B


@pytest.mark.parametrize("h_kv, group", [(1, 1), (2, 3), (1, 7), (4, 2)])
def test_quest_bounds_and_scores(h_kv, group):
    g = torch.Generator().manual_seed(h_kv * 10 + group)
    d, bs, m = 16, 3, 6
    k_buffer = torch.randn(64 * B, h_kv, d, generator=g)
    pages = torch.tensor([1, 5, 9, 63])
    torch.testing.assert_close(key_bounds(k_buffer, pages, B), quest_naive.key_bounds(k_buffer, pages, B))
    bounds = key_bounds(k_buffer, torch.arange(64), B)
    q = torch.randn(bs, h_kv * group, d, generator=g)
    table, n_cand = _table(g, bs, m), torch.tensor([0, 3, 6])
    torch.testing.assert_close(quest_scores(q, bounds, table, n_cand, B, m),
                               quest_naive.quest_scores(q, bounds, table, n_cand, B, m), rtol=1e-5, atol=1e-5)


def test_force_anchors():
    g = torch.Generator().manual_seed(3)
    scores = torch.randn(3, 2, 7, generator=g)
    anchors = torch.tensor([[[0, 6], [-1, 3]], [[2, 2], [9, -1]], [[5, 1], [4, 0]]], dtype=torch.int32)
    n_cand = torch.tensor([7, 3, 0])  # request 1: anchor 9 past its candidates; request 2: none
    want = anchors_naive.force_anchors(scores, anchors, n_cand)
    assert torch.equal(force_anchors(scores, anchors, n_cand), want)
    assert want[0, 0, 6] == float("inf") and want[1, 1, 0] != float("inf") and not torch.isinf(want[2]).any()


@pytest.mark.parametrize("h_kv", [1, 3])
def test_kv_index_rows(h_kv):
    g = torch.Generator().manual_seed(h_kv)
    k = 3
    seq_lens = torch.tensor([1, 5 * B, 5 * B + 3, 2 * B + 1])  # no candidates; a full current block; mixed
    m = int(seq_lens.max()) // B + 1
    table = _table(g, seq_lens.numel(), m)
    selected = torch.full((seq_lens.numel(), h_kv, k), -1, dtype=torch.int32)
    for r, n in enumerate(seq_lens.tolist()):
        cur = max(n - 1, 0) // B
        for h in range(h_kv):
            pick = torch.randperm(cur, generator=g)[: min(k, cur)].sort().values
            selected[r, h, : pick.numel()] = pick.to(torch.int32)
    indptr = kv_indptr_for(seq_lens, k, B, h_kv)
    got = build_kv_indices(selected, table, seq_lens, B, indptr, torch.zeros(int(indptr[-1]), dtype=torch.int32))
    want_ptr, want = gather_naive.build_kv_indices(selected, table, seq_lens, B)
    assert torch.equal(indptr, want_ptr) and torch.equal(got, want)


@pytest.mark.parametrize("sink, local", [(0, 0), (1, 0), (0, 2), (2, 3), (5, 5)])
def test_forced_tiers(sink, local):
    n_cand = torch.tensor([0, 1, 3, 8, 12])
    assert torch.equal(forced_tier(n_cand, 12, sink, local), topk_naive.forced_tier(n_cand, 12, sink, local))
