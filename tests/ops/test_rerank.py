"""The exact second level (`ops.rerank`): the Triton kernel and the torch path against the plain statement, on a
paged cache with mixed lengths (no candidate, fewer than K, between K and C, many), GQA 1-8 (3 and 7 included),
bf16 / fp32 / fp8 keys, sink / local blocks, prompt anchors read through the batch's pool rows, and splits."""

import pytest
import torch

from sas_backend.ops.rerank import RerankWorkspace, rerank_blocks
from sas_backend.ops.rerank import naive
from sas_backend.ops.rerank.torch_path import exact_block_scores
from sas_backend.ops.rerank.triton import rerank_blocks_triton
from sas_backend.ops.topk.naive import select_blocks
from tests.devices import DEVICE
from tests.ops.conftest import PagedCase

B = 16


def _case(lens, h_kv, g, k, factor, dtype, seed=0, sink=1, local=1, anchors=0, d=32):
    """(inputs of rerank_blocks, the plain statement's answer): the first level is the plain top-K of random scores at
    factor x K with the forced blocks (and anchors) in, as the server's first level picks."""
    case = PagedCase(lens, B, h_kv, d, seed=seed)
    gen = case.gen
    table = case.block_table()
    m = case.max_blocks
    ncand = case.num_candidates
    kv = torch.randn(case.slots, h_kv, d, generator=gen)
    kv[:, :, :4] *= 4  # a few channels dominate, as in real keys: masses far from uniform
    k_scale = 1.0
    if dtype in (torch.float8_e4m3fn,):
        k_scale = 0.5
        k_buffer = (kv / k_scale).to(dtype)
        q_dtype = torch.bfloat16
    else:
        k_buffer, q_dtype = kv.to(dtype), dtype
    q = (torch.randn(len(lens), h_kv * g, d, generator=gen) * 2).to(q_dtype)
    pool = None
    if anchors:
        pool = torch.full((case.req_to_token.shape[0], h_kv, anchors), -1, dtype=torch.int32)
        for r, n in enumerate(ncand.tolist()):
            if n:
                pool[int(case.req_pool_indices[r])] = torch.randint(0, n, (h_kv, anchors), generator=gen,
                                                                    dtype=torch.int32)
        pool[int(case.req_pool_indices[0]), 0, -1] = -1
    rows = None if pool is None else pool[case.req_pool_indices.long().cpu()]
    scores = torch.randn(len(lens), h_kv, m, generator=gen)
    if rows is not None:
        from sas_backend.ops.anchors.naive import force_anchors
        scores = force_anchors(scores, rows, ncand.cpu())
    first = select_blocks(scores, ncand.cpu(), factor * k, sink, local)
    want = naive.rerank_blocks(q.cpu(), k_buffer.cpu(), first, table.cpu(), ncand.cpu(), k, m, d ** -0.5, B, sink,
                               local, rows, k_scale)
    args = dict(q=q.to(DEVICE), k_buffer=k_buffer.to(DEVICE), first=first.to(DEVICE), block_table=table,
                num_candidates=ncand, k=k, scale=d ** -0.5, block_size=B, sink_blocks=sink, local_blocks=local,
                k_scale=k_scale)
    return args, m, pool, case.req_pool_indices, want


LENS = [1, 5 * B + 3, 9 * B, 14 * B + 1, 40 * B + 7]  # no candidate, < K, K < n < C, many


@pytest.mark.parametrize("g", [1, 3, 4, 7, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_the_statement(g, dtype):
    args, m, _, _, want = _case(LENS, 2, g, k=6, factor=2, dtype=dtype, seed=g)
    ws = RerankWorkspace(len(LENS), 2, g, 12, DEVICE, target_programs=3 * len(LENS) * 2)  # 3 splits a row
    got = rerank_blocks_triton(**args, anchors=None, anchor_rows=None, ws=ws)
    assert torch.equal(got.cpu(), want), f"\n{got}\n{want}"
    assert int(ws.counters.abs().sum()) == 0  # left zero for the next launch


def test_fp32_keys_in_token_tiles(monkeypatch):
    """fp32 keys are read in 16-token tiles with an online log-sum-exp on a GPU (a whole block's tile spills): the
    same answer (forced here by taking the GPU's launch choice in the interpreter)."""
    import sas_backend.ops.rerank.triton as kernels

    monkeypatch.setattr(kernels, "_interpreting", lambda: False)
    args, m, _, _, want = _case(LENS, 2, 3, k=6, factor=2, dtype=torch.float32, seed=21)
    got = kernels.rerank_blocks_triton(**args, anchors=None, anchor_rows=None, ws=RerankWorkspace(8, 2, 3, 12, DEVICE))
    assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_torch_path_matches_the_statement(dtype):
    args, m, _, _, want = _case(LENS, 3, 2, k=5, factor=3, dtype=dtype, seed=11)
    got = rerank_blocks(**args, max_blocks=m)
    assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_anchors_from_the_pool_rows_and_fp8_keys(impl):
    args, m, pool, rows, want = _case(LENS, 2, 4, k=7, factor=2, dtype=torch.float8_e4m3fn, seed=5, anchors=2)
    if impl == "triton":
        ws = RerankWorkspace(8, 2, 4, 14, DEVICE)
        got = rerank_blocks_triton(**args, anchors=pool.to(DEVICE), anchor_rows=rows, ws=ws)
    else:
        got = rerank_blocks(**args, max_blocks=m, anchors=pool.to(DEVICE), anchor_rows=rows)
    assert torch.equal(got.cpu(), want)
    for r, n in enumerate(args["num_candidates"].tolist()):  # every anchor the row had is kept
        for h in range(2):
            kept = set(got[r, h].tolist())
            assert {a for a in pool[int(rows[r]), h].tolist() if 0 <= a < n} <= kept


def test_budget_covering_every_candidate_and_one_split():
    """Rows with at most K candidates keep them all; one split per row (a full batch) gives the same answer."""
    args, m, _, _, want = _case([3 * B + 1, 6 * B, 2], 1, 7, k=8, factor=2, dtype=torch.bfloat16, seed=3,
                                sink=0, local=0)
    ws = RerankWorkspace(3, 1, 7, 16, DEVICE, target_programs=1)
    assert ws.splits(3) == 1
    got = rerank_blocks_triton(**args, anchors=None, anchor_rows=None, ws=ws)
    assert torch.equal(got.cpu(), want)
    assert got[0, 0].tolist()[:3] == [0, 1, 2] and got[2, 0].tolist() == [-1] * 8


def test_exact_scores_are_the_blocks_attention_mass():
    """The log-masses exponentiate to each block's share of the softmax over the first-level tokens (G = 1)."""
    args, m, _, _, _ = _case([20 * B + 5], 1, 1, k=4, factor=3, dtype=torch.float32, seed=7, sink=0, local=0)
    q, kb, first, table = args["q"].cpu(), args["k_buffer"].cpu(), args["first"].cpu(), args["block_table"].cpu()
    s = exact_block_scores(q, kb, first, table, B, args["scale"])
    blocks = first[0, 0].tolist()
    keys = torch.cat([kb[int(table[0, b]):int(table[0, b]) + B, 0] for b in blocks])
    p = torch.softmax(q[0, 0] @ keys.T * args["scale"], dim=0).view(len(blocks), B).sum(-1)
    torch.testing.assert_close(s[0, 0].exp(), p, rtol=1e-5, atol=1e-6)
    assert abs(float(s[0, 0].exp().sum()) - 1.0) < 1e-5


def _codes(args):
    """`ops.key_codes` of every page of the case's cache (pages = slots // B), built by the torch path."""
    from sas_backend.ops.key_codes import encode_pages

    kb = args["k_buffer"]
    pages, h_kv, d = kb.shape[0] // B, kb.shape[1], kb.shape[2]
    packed = torch.zeros(pages, h_kv, B * d // 2, dtype=torch.uint8, device=kb.device)
    scales = torch.zeros(pages, h_kv, 2, d, dtype=torch.float16, device=kb.device)
    encode_pages(kb, torch.arange(pages, device=kb.device), B, packed, scales, args["k_scale"], kernel=False)
    return packed, scales


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("g,dtype", [(1, torch.float32), (3, torch.bfloat16), (7, torch.float8_e4m3fn)])
def test_keys_read_from_their_4bit_codes(impl, g, dtype):
    """key_codes: the second level reads each block's keys from its page's 4-bit codes (`ops.key_codes`): the kernel
    and the torch path answer as the plain statement over the decoded keys (anchors, splits, fp8 caches whose codes
    hold K itself), and the codes are really read: scores move from the exact keys' by about the codes' error."""
    from sas_backend.ops.rerank import naive as plain

    args, m, pool, rows, _ = _case(LENS, 2, g, k=6, factor=2, dtype=dtype, seed=30 + g, anchors=2)
    codes = _codes(args)
    table, ncand = args["block_table"].cpu(), args["num_candidates"].cpu()
    anchors_b = pool[rows.long().cpu()]
    want = plain.rerank_blocks(args["q"].cpu(), args["k_buffer"].cpu(), args["first"].cpu(), table, ncand, 6, m,
                               args["scale"], B, 1, 1, anchors_b, args["k_scale"], key_codes=codes)
    if impl == "triton":
        ws = RerankWorkspace(len(LENS), 2, g, 12, DEVICE, target_programs=3 * len(LENS) * 2)
        got = rerank_blocks_triton(**args, anchors=pool.to(DEVICE), anchor_rows=rows, ws=ws, key_codes=codes)
        assert int(ws.counters.abs().sum()) == 0
    else:
        got = rerank_blocks(**args, max_blocks=m, anchors=pool.to(DEVICE), anchor_rows=rows, key_codes=codes)
    assert torch.equal(got.cpu(), want)
    q, kb, first = args["q"].cpu(), args["k_buffer"].cpu(), args["first"].cpu()
    exact = exact_block_scores(q, kb, first, table, B, args["scale"], args["k_scale"])
    coded = exact_block_scores(q, kb, first, table, B, args["scale"], args["k_scale"], key_codes=codes)
    finite = torch.isfinite(exact)
    assert torch.equal(finite, torch.isfinite(coded))
    gap = (exact - coded)[finite].abs()
    assert 0 < float(gap.max()) < 1.0 and float(gap.mean()) < 0.2


def test_bad_arguments_are_refused():
    args, m, _, _, _ = _case([10 * B], 2, 2, k=4, factor=2, dtype=torch.float32)
    with pytest.raises(ValueError, match="K = 9"):
        rerank_blocks(**{**args, "k": 9}, max_blocks=m)
    with pytest.raises(ValueError, match="RerankWorkspace"):
        rerank_blocks_triton(**args, anchors=None, anchor_rows=None, ws=RerankWorkspace(1, 2, 2, 4, DEVICE))
    packed, scales = _codes(args)
    with pytest.raises(ValueError, match="key codes"):
        rerank_blocks(**args, max_blocks=m, key_codes=(packed, scales.float()))
