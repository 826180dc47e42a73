"""The plain-torch reference ops against brute-force statements of the design's semantics."""

from __future__ import annotations

import math

import pytest
import torch

from sas_backend.ops.gate.torch_path import gate_query
from sas_backend.ops.gather.torch_path import build_kv_indices, kv_indptr_for
from sas_backend.ops.rope import apply_rope, invert_rope, rope_cos_sin_table
from sas_backend.ops.score.torch_path import score_blocks
from sas_backend.ops.sparse_decode.naive import sparse_decode_attention
from sas_backend.ops.summary.torch_path import summarize_blocks, summarize_pages
from sas_backend.ops.topk.naive import select_blocks


def brute_select(scores, n_cand, k, sink, local):
    """One (request, head) row, written as the design states it."""
    cands = list(range(n_cand))
    if n_cand <= k:
        return cands
    forced = [m for m in cands if m < sink] + [m for m in cands if m >= n_cand - local and m >= sink]
    forced = forced[:k]
    rest = [m for m in cands if m not in forced]
    rest.sort(key=lambda m: (-scores[m], m))  # higher score first, ties to the lower index
    return sorted(forced + rest[: k - len(forced)])


@pytest.mark.parametrize("sink,local", [(0, 0), (1, 0), (0, 2), (1, 2)])
def test_select_blocks_matches_brute_force(sink, local):
    g = torch.Generator().manual_seed(0)
    bs, h, m, k = 6, 3, 20, 5
    scores = torch.randint(0, 4, (bs, h, m), generator=g).float()  # many ties on purpose
    n_cand = torch.tensor([0, 3, 5, 6, 13, 20])
    sel = select_blocks(scores, n_cand, k, sink, local)
    assert sel.shape == (bs, h, k) and sel.dtype == torch.int32
    for r in range(bs):
        for hh in range(h):
            want = brute_select(scores[r, hh].tolist(), int(n_cand[r]), k, sink, local)
            got = [x for x in sel[r, hh].tolist() if x >= 0]
            assert got == want, (r, hh, got, want)
            assert sel[r, hh].tolist()[len(got):] == [-1] * (k - len(got))


def test_rope_invert_is_exact_inverse_and_matches_hf_formula():
    table = rope_cos_sin_table(64, 300, 100000.0)
    x = torch.randn(300, 3, 64)
    y = apply_rope(x, table)
    assert torch.allclose(invert_rope(y, table), x, atol=1e-5)
    # transformers' rotate_half convention: x*cos + rotate_half(x)*sin with duplicated halves
    cos = torch.cat([table[:, :32]] * 2, -1)[:, None]
    sin = torch.cat([table[:, 32:]] * 2, -1)[:, None]
    rot = torch.cat([-x[..., 32:], x[..., :32]], -1)
    assert torch.allclose(y, x * cos + rot * sin, atol=1e-5)


def test_gate_query_and_summary_follow_the_formulas():
    g = torch.Generator().manual_seed(1)
    h_kv, grp, d, dg, b = 2, 3, 8, 16, 4
    w_q = torch.randn(h_kv, grp, d, dg, generator=g)
    w_k = torch.randn(h_kv, 3 * d, dg, generator=g)
    qn, kn = torch.rand(dg, generator=g) + 0.5, torch.rand(dg, generator=g) + 0.5
    table = rope_cos_sin_table(dg, 64, 10000.0)
    q = torch.randn(5, h_kv * grp, d, generator=g)
    pos = torch.tensor([0, 3, 9, 17, 40])
    out = gate_query(q, w_q, qn, table[pos])
    for n in range(5):
        for h in range(h_kv):
            proj = sum(q[n, h * grp + j] @ w_q[h, j] for j in range(grp))
            normed = proj / torch.sqrt(proj.pow(2).mean() + 1e-6) * qn
            assert torch.allclose(out[n, h], apply_rope(normed[None], table[pos[n]][None])[0], atol=1e-4)
    keys = torch.randn(3, b, h_kv, d, generator=g)
    starts = torch.tensor([0, 4, 8])
    summ = summarize_blocks(keys, w_k, kn, table[starts])
    for n in range(3):
        for h in range(h_kv):
            kk = keys[n, :, h]
            pooled = torch.cat([kk.max(0).values, kk.min(0).values, kk.mean(0)])
            proj = pooled @ w_k[h]
            normed = proj / torch.sqrt(proj.pow(2).mean() + 1e-6) * kn
            assert torch.allclose(summ[n, h], apply_rope(normed[None], table[starts[n]][None])[0], atol=1e-4)


def _paged_world(lens, b=4, h_kv=2, d=8, pages=32, seed=0):
    """A req_to_token table with shuffled page-aligned slots for requests of the given lengths."""
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(pages - 1, generator=g) + 1  # page 0 is padding
    r2t = torch.zeros(len(lens), 64, dtype=torch.int32)
    used = 0
    for r, n in enumerate(lens):
        for m in range((n + b - 1) // b):
            page = int(order[used])
            used += 1
            r2t[r, m * b : (m + 1) * b] = torch.arange(page * b, page * b + b, dtype=torch.int32)
    k_buf = torch.randn(pages * b, h_kv, d, generator=g)
    v_buf = torch.randn(pages * b, h_kv, d, generator=g)
    return r2t, k_buf, v_buf


def _table(r2t, b):
    """The ops' block table `[bs, M + 1]`: KV slot of each logical block's first token."""
    return r2t[:, ::b].long()


def _indices(sel, lens, r2t, b):
    indptr = kv_indptr_for(lens, sel.shape[-1], b, sel.shape[1])
    idx = build_kv_indices(sel, _table(r2t, b), lens, b, indptr, torch.zeros(int(indptr[-1]), dtype=torch.int32))
    return indptr, idx


def test_scores_read_the_right_pages():
    b, h_kv, dg = 4, 2, 8
    lens = torch.tensor([3, 9, 21])
    r2t, _, _ = _paged_world(lens.tolist(), b=b, h_kv=h_kv)
    summaries = torch.randn(32, h_kv, dg)
    qg = torch.randn(3, h_kv, dg)
    s = score_blocks(qg, summaries, _table(r2t, b), (lens - 1) // b, b, max_blocks=6)
    for r, n in enumerate(lens.tolist()):
        n_cand = (n - 1) // b
        for m in range(6):
            if m < n_cand:
                page = int(r2t[r, m * b]) // b
                want = (qg[r] * summaries[page]).sum(-1) / math.sqrt(dg)
                assert torch.allclose(s[r, :, m], want, atol=1e-5)
            else:
                assert torch.isinf(s[r, :, m]).all() and (s[r, :, m] < 0).all()


def test_sparse_decode_with_everything_selected_equals_dense():
    b, h_kv, grp, d = 4, 2, 3, 8
    lens = torch.tensor([1, 4, 5, 22])
    r2t, k_buf, v_buf = _paged_world(lens.tolist(), b=b, h_kv=h_kv, d=d)
    k = 8
    n_cand = (lens - 1) // b
    sel = torch.full((4, h_kv, k), -1, dtype=torch.int32)
    for r in range(4):
        sel[r, :, : int(n_cand[r])] = torch.arange(int(n_cand[r]), dtype=torch.int32)
    indptr, idx = _indices(sel, lens, r2t, b)
    q = torch.randn(4, h_kv * grp, d)
    out = sparse_decode_attention(q, k_buf, v_buf, indptr, idx, scale=d**-0.5)
    for r, n in enumerate(lens.tolist()):
        slots = r2t[r, :n].long()
        for hq in range(h_kv * grp):
            h = hq // grp
            att = torch.softmax(k_buf[slots, h] @ q[r, hq] * d**-0.5, 0)
            assert torch.allclose(out[r, hq], att @ v_buf[slots, h], atol=1e-5)


def test_sparse_decode_attends_only_selected_blocks_and_current():
    b, h_kv, grp, d = 4, 2, 2, 8
    lens = torch.tensor([22])
    r2t, k_buf, v_buf = _paged_world(lens.tolist(), b=b, h_kv=h_kv, d=d)
    sel = torch.tensor([[[1, 3], [0, 4]]], dtype=torch.int32)
    indptr, idx = _indices(sel, lens, r2t, b)
    assert indptr.tolist() == [0, 10, 20]  # 2 blocks of 4 + the current block's 2 tokens
    q = torch.randn(1, h_kv * grp, d)
    out = sparse_decode_attention(q, k_buf, v_buf, indptr, idx, scale=0.3)
    for h, blocks in enumerate([[1, 3], [0, 4]]):
        pos = [m * b + i for m in blocks for i in range(b)] + [20, 21]
        slots = r2t[0, pos].long()
        assert idx[indptr[h] : indptr[h + 1]].tolist() == (slots * h_kv + h).tolist()
        for j in range(grp):
            att = torch.softmax(k_buf[slots, h] @ q[0, h * grp + j] * 0.3, 0)
            assert torch.allclose(out[0, h * grp + j], att @ v_buf[slots, h], atol=1e-5)


def test_summarize_pages_reads_back_post_rope_keys():
    b, h_kv, d, dg = 4, 2, 8, 16
    model_table = rope_cos_sin_table(d, 64, 10000.0)
    gate_table = rope_cos_sin_table(dg, 64, 10000.0)
    w_k, kn = torch.randn(h_kv, 3 * d, dg), torch.ones(dg)
    pre = torch.randn(8, h_kv, d)  # positions 8..15 = logical block 2, stored in page 5
    k_buf = torch.zeros(40, h_kv, d)
    k_buf[20:28] = apply_rope(pre, model_table[8:16])
    got = summarize_pages(k_buf, torch.tensor([5, 6]), torch.tensor([8, 12]), model_table, gate_table, w_k, kn, b)
    want = summarize_blocks(pre.view(2, b, h_kv, d), w_k, kn, gate_table[torch.tensor([8, 12])])
    assert torch.allclose(got, want, atol=1e-4)
