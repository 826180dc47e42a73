"""The batched torch decode path (what CPU serving runs) against the plain references.

Each fast op is a second implementation of a reference in ops/*/naive.py: Top-K by one topk over
unique keys, the gate query with rotations as `x*c + roll(x)*s`,
sparse attention as one masked SDPA over padded rows, the masked summary update. Each op's
entry point (`sas_backend.ops.<op>`) picks exactly these on CPU; the last test checks that."""

import pytest
import torch

from sas_backend.ops.gate.torch_path import gate_query_torch
from sas_backend.ops.gate.torch_path import gate_query
from sas_backend.ops.gather.torch_path import build_kv_indices, kv_indptr_for
from sas_backend.ops.rope import apply_rope, invert_rope, rope_cos_sin_table, rotate, rotation_factors
from sas_backend.ops.score.torch_path import candidate_counts, score_blocks
from sas_backend.ops.sparse_decode.torch_path import TorchSparseDecode, padded_token_rows, sparse_decode_padded
from sas_backend.ops.sparse_decode.naive import sparse_decode_attention
from sas_backend.ops.summary.torch_path import summary_update_decode_masked
from sas_backend.ops.summary.naive import summary_update_decode
from sas_backend.ops.topk.torch_path import select_blocks_torch
from sas_backend.ops.topk.naive import select_blocks


# More forced blocks than K is refused by the config, so those combinations are not drawn.
@pytest.mark.parametrize(
    "k,sink,local",
    [(k, s, local) for k in (1, 3, 8, 40) for s, local in ((0, 0), (1, 0), (1, 2), (0, 3)) if s + local <= k],
)
def test_topk_cpu_equals_reference(k, sink, local):
    g = torch.Generator().manual_seed(k * 10 + sink + local)
    bs, h, m = 5, 3, 37
    scores = torch.randn(bs, h, m, generator=g)
    scores[0, 0, 3:9] = 0.5  # ties: lower index first
    scores[1, 1, 2] = float("nan")
    scores[1, 2, :] = float("-inf")
    scores[2, 0, 4] = float("inf")
    scores[2, 1, 5] = -0.0
    scores[2, 1, 6] = 0.0
    n_cand = torch.tensor([37, 20, 2, 0, 9])
    got = select_blocks_torch(scores, n_cand, k, sink, local)
    want = select_blocks(scores, n_cand, k, sink, local)
    assert torch.equal(got, want)


def test_topk_cpu_random_rounded_scores_many_ties():
    g = torch.Generator().manual_seed(7)
    scores = torch.randint(-3, 3, (4, 8, 300), generator=g).float()
    n_cand = torch.tensor([300, 299, 64, 1])
    for k in (2, 16, 64):
        assert torch.equal(select_blocks_torch(scores, n_cand, k, 1, 1), select_blocks(scores, n_cand, k, 1, 1))



@pytest.mark.parametrize("k,sink,local", [(1, 0, 0), (3, 1, 0), (8, 1, 2), (8, 0, 3)])
def test_select_among_candidates_equals_the_whole_row(k, sink, local):
    """`select_among` (the second level's Top-K over its first level's candidates on CPU) keeps what the reference keeps
    over the whole row holding those candidates' scores and -inf elsewhere, when the candidates hold every forced
    block and at least K blocks (or every block), as a first level's pick does; ties, +inf and -0.0 included (a
    candidate at -inf or NaN would tie with the row's other blocks, which the candidate list does not hold)."""
    from sas_backend.ops.topk.torch_path import select_among

    g = torch.Generator().manual_seed(7 * k + sink + local)
    bs, h, m, c = 5, 3, 40, 2 * k + 3
    scores = torch.randn(bs, h, m, generator=g)
    scores[0, 0, 3:12] = 0.5
    scores[2, 0, 4] = float("inf")
    scores[2, 1, 5], scores[2, 1, 6] = -0.0, 0.0
    n_cand = torch.tensor([40, 20, k, 0, 9])
    blocks = torch.full((bs, h, c), -1, dtype=torch.int32)
    for r, n in enumerate(n_cand.tolist()):
        forced = [b for b in range(n) if b < sink or b >= n - local]
        for hh in range(h):
            rest = [b for b in torch.randperm(n, generator=g).tolist() if b not in forced]
            pick = sorted(forced + rest[: max(0, min(n, c) - len(forced))])
            blocks[r, hh, : len(pick)] = torch.tensor(pick, dtype=torch.int32)
    cand_scores = torch.gather(scores, -1, blocks.clamp_min(0).long())
    got = select_among(cand_scores, blocks, n_cand, k, m, sink, local)
    whole = torch.full((bs, h, m + 1), float("-inf"))
    whole.scatter_(-1, torch.where(blocks >= 0, blocks.long(), m), cand_scores)
    assert torch.equal(got, select_blocks(whole[..., :m], n_cand, k, sink, local))


@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gate_query_cpu_equals_reference(group, dtype):
    g = torch.Generator().manual_seed(group)
    n, h_kv, d, dg = 6, 2, 64, 32
    model_tab = rope_cos_sin_table(d, 9000, 100000.0)
    gate_tab = rope_cos_sin_table(dg, 9000, 100000.0)
    pos = torch.tensor([0, 1, 63, 64, 4097, 8999])
    q_post = torch.randn(n, h_kv * group, d, generator=g).to(dtype)
    w_q = torch.randn(h_kv, group, d, dg, generator=g) / (group * d) ** 0.5
    q_norm = torch.rand(dg, generator=g) + 0.5
    want = gate_query(invert_rope(q_post, model_tab[pos]), w_q, q_norm, gate_tab[pos])
    got = gate_query_torch(q_post, model_tab[pos], w_q, q_norm, gate_tab[pos])
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_rotation_factors_invert_a_scaled_rotation_exactly():
    # YaRN bakes a magnitude (mscale) into cos/sin: the inverse must undo it, not just the angle.
    g = torch.Generator().manual_seed(0)
    tab = rope_cos_sin_table(64, 100, 10000.0) * 1.37
    x = torch.randn(100, 4, 64, generator=g)
    y = apply_rope(x, tab)
    c, s = rotation_factors(tab, inverse=True)
    back = rotate(y, c, s)
    torch.testing.assert_close(back, x, atol=1e-5, rtol=1e-5)
    fc, fs = rotation_factors(tab, inverse=False)
    torch.testing.assert_close(rotate(x, fc, fs), y, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [1, 2, 20])
def test_padded_sparse_decode_equals_reference(paged_case, group, dtype, k):
    """Mixed lengths: within one block, exactly K, fewer and more candidates than K (k=20 covers
    every request: dense), a partial current block and a full one."""
    b, h_kv, d = 4, 2, 16
    lens = [1, b, b + 3, 3 * b, 9 * b + 1, 6 * b + 2]
    case = paged_case(lens, b, h_kv, d, seed=group)
    cpu = lambda t: t.cpu()  # noqa: E731
    table, seq = cpu(case.block_table(12)), cpu(case.seq_lens)
    g = torch.Generator().manual_seed(k)
    k_buf = torch.randn(case.slots, h_kv, d, generator=g).to(dtype)
    v_buf = torch.randn(case.slots, h_kv, d, generator=g).to(dtype)
    q = torch.randn(len(lens), h_kv * group, d, generator=g).to(dtype)
    n_cand = candidate_counts(seq, b)
    scores = torch.randn(len(lens), h_kv, 12, generator=g)
    selected = select_blocks(scores, n_cand, k)
    indptr = kv_indptr_for(seq, k, b, h_kv)
    indices = build_kv_indices(selected, table, seq, b, indptr, torch.zeros(int(indptr[-1]), dtype=torch.int32))
    want = sparse_decode_attention(q, k_buf, v_buf, indptr, indices, 0.25)
    rows, valid = padded_token_rows(selected, table, seq, h_kv, b)
    # The valid tokens of each padded row are exactly the reference row, in order.
    for r in range(len(lens)):
        for h in range(h_kv):
            row = indices[indptr[r * h_kv + h] : indptr[r * h_kv + h + 1]].long()
            assert torch.equal(rows[r, h][valid[r, h]], row)
    got = sparse_decode_padded(q, k_buf, v_buf, rows, valid, 0.25)
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got, want, **tol)
    sd = TorchSparseDecode(h_kv, b)  # the plan/run object the backend holds
    sd.plan(seq, 0.25)
    torch.testing.assert_close(sd.run(q, k_buf, v_buf, selected, table, seq), got, atol=0, rtol=0)
    with pytest.raises(ValueError, match="plan"):
        sd.run(q[:2], k_buf, v_buf, selected[:2], table[:2], seq[:2])


def test_masked_summary_update_equals_reference(paged_case):
    b, h_kv, d, dg = 4, 2, 8, 16
    lens = [b, 2 * b + 1, 3 * b, 1, 5 * b]  # three requests complete a block this step
    case = paged_case(lens, b, h_kv, d)
    table, seq = case.block_table(6).cpu(), case.seq_lens.cpu()
    g = torch.Generator().manual_seed(3)
    model_tab = rope_cos_sin_table(d, 64, 10000.0)
    gate_tab = rope_cos_sin_table(dg, 64, 10000.0)
    k_buf = torch.randn(case.slots, h_kv, d, generator=g)
    w_k = torch.randn(h_kv, 3 * d, dg, generator=g)
    k_norm = torch.rand(dg, generator=g) + 0.5
    start = torch.randn(case.num_pages + 1, h_kv, dg, generator=g)
    want = summary_update_decode(k_buf, start.clone(), table, seq, b, model_tab, gate_tab, w_k, k_norm)
    got = summary_update_decode_masked(k_buf, start.clone(), table, seq, b, model_tab, gate_tab, w_k, k_norm)
    # Every page a request owns is identical; only page 0 (padding, never owned) may differ.
    torch.testing.assert_close(got[1:], want[1:])
    assert not torch.equal(want[1:], start[1:])  # the step did write summaries


def test_entry_points_pick_the_cpu_paths_off_cuda(paged_case):
    """`sas_backend.ops.<op>.<entry>` on CPU tensors returns exactly what the CPU path returns
    (one signature for the kernel and the torch path; the backend calls only these)."""
    from sas_backend import ops
    from sas_backend.ops import gate, gather, score, summary, topk  # noqa: F401

    b, h_kv, d, dg = 4, 2, 8, 16
    lens = [b, 2 * b + 1, 3 * b, 1, 5 * b]
    case = paged_case(lens, b, h_kv, d)
    table, seq = case.block_table(7).cpu(), case.seq_lens.cpu()
    n_cand = candidate_counts(seq, b)
    g = torch.Generator().manual_seed(5)
    model_tab, gate_tab = rope_cos_sin_table(d, 64, 10000.0), rope_cos_sin_table(dg, 64, 10000.0)
    q = torch.randn(len(lens), 2 * h_kv, d, generator=g)
    w_q, q_norm = torch.randn(h_kv, 2, d, dg, generator=g), torch.rand(dg, generator=g) + 0.5
    gq = ops.gate.gate_query_post_rope(q, model_tab[seq - 1], w_q, q_norm, gate_tab[seq - 1])
    assert torch.equal(gq, gate_query_torch(q, model_tab[seq - 1], w_q, q_norm, gate_tab[seq - 1]))
    summ = torch.randn(case.num_pages + 1, h_kv, dg, generator=g)
    sc = ops.score.score_blocks(gq, summ, table, n_cand, b, 6)
    assert torch.equal(sc, score_blocks(gq, summ, table, n_cand, b, 6))
    out = torch.empty(len(lens), h_kv, 2, dtype=torch.int32)
    sel = ops.topk.select_blocks(sc, n_cand, 2, 1, 0, out=out)
    assert sel is out and torch.equal(sel, select_blocks_torch(sc, n_cand, 2, 1, 0))
    indptr = kv_indptr_for(seq, 2, b, h_kv)
    buf = torch.full((int(indptr[-1]) + 5,), -7, dtype=torch.int32)
    ops.gather.gather_kv_indices(sel, table, seq, b, indptr, buf)
    assert torch.equal(buf[: int(indptr[-1])],
                       build_kv_indices(sel, table, seq, b, indptr, torch.zeros_like(buf))[: int(indptr[-1])])
    assert torch.equal(buf[int(indptr[-1]) :], torch.full((5,), -7, dtype=torch.int32))  # the rest untouched
    k_buf = torch.randn(case.slots, h_kv, d, generator=g)
    w_k, k_norm = torch.randn(h_kv, 3 * d, dg, generator=g), torch.rand(dg, generator=g) + 0.5
    start = torch.randn(case.num_pages + 1, h_kv, dg, generator=g)
    got = ops.summary.update_summaries(k_buf, start.clone(), table, seq, b, model_tab, gate_tab, w_k, k_norm)
    want = summary_update_decode_masked(k_buf, start.clone(), table, seq, b, model_tab, gate_tab, w_k, k_norm)
    assert torch.equal(got, want)
