"""The decode-step chain on the Triton ops (summaries -> scores -> Top-K -> KV indices) against
the same chain on the plain-torch references, over GQA groups 1/3/4/8."""

import pytest
import torch

from sas_backend.ops.gate.torch_path import gate_query
from sas_backend.ops.gather.torch_path import build_kv_indices
from sas_backend.ops.gather.triton import build_kv_indices_triton
from sas_backend.ops.gather.torch_path import kv_indptr_for
from sas_backend.ops.rope import apply_rope, rope_cos_sin_table
from sas_backend.ops.score.torch_path import candidate_counts, score_blocks
from sas_backend.ops.score.triton import score_blocks_triton
from sas_backend.ops.sparse_decode.naive import sparse_decode_attention
from sas_backend.ops.summary.torch_path import summarize_pages
from sas_backend.ops.summary.triton import summarize_pages_triton
from sas_backend.ops.topk.naive import select_blocks
from sas_backend.ops.topk.triton import select_blocks_triton
from tests.devices import DEVICE


def _run(paged_case, group, k, kv_dtype=torch.float32, lens=None, seed=0):
    b, h_kv, d, dg = 4, 2, 16, 16
    lens = lens or [1, b, b + 3, 6 * b, 9 * b + 1]
    case = paged_case(lens, b, h_kv, d, seed=seed + group)
    g = case.gen

    def randn(*shape):  # drawn on the CPU generator (same data on every device), on DEVICE
        return torch.randn(*shape, generator=g).to(DEVICE)

    model_cs = rope_cos_sin_table(d, 256, 10000.0, device=DEVICE)
    gate_cs = rope_cos_sin_table(dg, 256, 10000.0, device=DEVICE)
    # Cache of post-RoPE keys and values at the positions the slots hold.
    slot_pos = torch.zeros(case.slots, dtype=torch.int64, device=DEVICE)
    for r, n in enumerate(lens):
        slot_pos[case.req_to_token[int(case.req_pool_indices[r]), :n].long()] = torch.arange(n, device=DEVICE)
    k_buf = apply_rope(randn(case.slots, h_kv, d), model_cs[slot_pos]).to(kv_dtype)
    v_buf = randn(case.slots, h_kv, d).to(kv_dtype)
    w_q = randn(h_kv, group, d, dg) / (group * d) ** 0.5
    w_k = randn(h_kv, 3 * d, dg) / (3 * d) ** 0.5
    q_norm = torch.rand(dg, generator=g).to(DEVICE) + 0.5
    k_norm = torch.rand(dg, generator=g).to(DEVICE) + 0.5
    bs = len(lens)
    q = randn(bs, h_kv * group, d)
    gq = gate_query(q, w_q, q_norm, gate_cs[case.seq_lens - 1])

    # Summaries of every page that holds a complete block (block start from the page's slots).
    pages, starts = [], []
    for r, n in enumerate(lens):
        for m in range(n // b):
            pages.append(int(case.req_to_token[int(case.req_pool_indices[r]), m * b]) // b)
            starts.append(m * b)
    pages, starts = torch.tensor(pages, device=DEVICE), torch.tensor(starts, device=DEVICE)
    results = []
    naive = (summarize_pages, score_blocks, select_blocks, build_kv_indices)
    kernels = (
        summarize_pages_triton,
        score_blocks_triton,
        select_blocks_triton,
        build_kv_indices_triton,
    )
    for summarize, score, select, gather in (naive, kernels):
        summ = torch.zeros(case.num_pages + 1, h_kv, dg, device=DEVICE)
        summ[pages] = summarize(k_buf, pages, starts, model_cs, gate_cs, w_k, k_norm, b)
        table, seq, n_cand = case.block_table(), case.seq_lens, candidate_counts(case.seq_lens, b)
        scores = score(gq, summ, table, n_cand, b, case.max_blocks)
        sel = select(scores, n_cand, k)
        indptr = kv_indptr_for(seq, k, b, h_kv)
        indices = gather(sel, table, seq, b, indptr, torch.zeros(int(indptr[-1]), dtype=torch.int32, device=DEVICE))
        out = sparse_decode_attention(q, k_buf, v_buf, indptr, indices, d**-0.5)
        results.append((scores, sel, indptr, indices, out))
    return case, q, k_buf, v_buf, results


@pytest.mark.parametrize("group", [1, 3, 4, 8])
def test_pipeline_matches_reference(paged_case, group):
    _, _, _, _, (ref, tri) = _run(paged_case, group, k=3)
    torch.testing.assert_close(tri[0], ref[0], rtol=1e-4, atol=1e-5)
    for a, b in zip(ref[1:4], tri[1:4]):
        assert torch.equal(a, b)
    torch.testing.assert_close(tri[4], ref[4])


def test_pipeline_bf16_cache(paged_case):
    _, _, _, _, (ref, tri) = _run(paged_case, 4, k=2, kv_dtype=torch.bfloat16)
    for a, b in zip(ref[1:4], tri[1:4]):
        assert torch.equal(a, b)


def test_pipeline_dense_when_few_candidates(paged_case):
    # At most K complete blocks per request: the sparse result equals dense decode attention.
    lens = [1, 4, 9, 17]
    case, q, k_buf, v_buf, (_, tri) = _run(paged_case, 3, k=4, lens=lens)
    g = q.shape[1] // k_buf.shape[1]
    for r, n in enumerate(lens):
        slots = case.req_to_token[int(case.req_pool_indices[r]), :n].long()
        ks = k_buf[slots].transpose(0, 1).repeat_interleave(g, 0)  # [H_q, n, D]
        vs = v_buf[slots].transpose(0, 1).repeat_interleave(g, 0)
        dense = torch.nn.functional.scaled_dot_product_attention(q[r][:, None], ks, vs, scale=16**-0.5)
        torch.testing.assert_close(tri[4][r], dense[:, 0], rtol=1e-5, atol=1e-6)
