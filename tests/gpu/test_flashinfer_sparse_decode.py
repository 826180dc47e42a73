"""FlashInfer sparse decode (one row per request x kv head) against the torch reference, on GPU,
eagerly and captured in a CUDA graph (plan outside, fill indices + run inside)."""

from __future__ import annotations

import pytest
import torch

from sas_backend.ops.gather.naive import build_kv_indices, kv_indptr_for
from sas_backend.ops.sparse_decode.naive import sparse_decode_attention

pytestmark = pytest.mark.gpu


def _world(lens, b, h_kv, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    n_pages = sum((n + b - 1) // b for n in lens) + 4
    order = torch.randperm(n_pages - 1, generator=g) + 1
    r2t = torch.zeros(len(lens), max(lens) + b, dtype=torch.int32)
    used = 0
    for r, n in enumerate(lens):
        for m in range((n + b - 1) // b):
            p = int(order[used]); used += 1
            r2t[r, m * b : (m + 1) * b] = torch.arange(p * b, p * b + b, dtype=torch.int32)
    k = torch.randn(n_pages * b, h_kv, d, generator=g).to(dtype)
    v = torch.randn(n_pages * b, h_kv, d, generator=g).to(dtype)
    return r2t.cuda(), k.cuda(), v.cuda()


def _random_selection(lens, h_kv, k_top, b, seed=0):
    g = torch.Generator().manual_seed(seed)
    sel = torch.full((len(lens), h_kv, k_top), -1, dtype=torch.int32)
    for r, n in enumerate(lens):
        n_cand = (n - 1) // b
        for h in range(h_kv):
            chosen = torch.randperm(n_cand, generator=g)[: min(k_top, n_cand)].sort().values
            sel[r, h, : chosen.numel()] = chosen.int()
    return sel.cuda()


@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flashinfer_matches_reference(group, dtype):
    from sas_backend.ops.sparse_decode.flashinfer import FlashInferSparseDecode

    b, h_kv, d, k_top = 64, 2, 128, 4
    lens = [1, 64, 65, 300, 1000, 4097]
    r2t, k_buf, v_buf = _world(lens, b, h_kv, d, dtype)
    seq = torch.tensor(lens, device="cuda")
    sel = _random_selection(lens, h_kv, k_top, b)
    indptr, idx = build_kv_indices(sel, seq, r2t, torch.arange(len(lens), device="cuda"), b)
    q = torch.randn(len(lens), h_kv * group, d, device="cuda", dtype=dtype)
    ref = sparse_decode_attention(q, k_buf, v_buf, indptr, idx, scale=d**-0.5)
    fi = FlashInferSparseDecode(h_kv, group, d, dtype, dtype, "cuda", max_rows=64, max_indices=1 << 16)
    buf = fi.plan(indptr.cpu(), d**-0.5)
    buf[: idx.numel()] = idx
    out = fi.run(q, k_buf, v_buf)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


def test_cuda_graph_capture_and_replay():
    from sas_backend.ops.gather.triton import build_kv_indices_triton
    from sas_backend.ops.sparse_decode.flashinfer import FlashInferSparseDecode

    b, h_kv, group, d, k_top, dtype = 64, 2, 4, 128, 4, torch.bfloat16
    lens_a, lens_b = [300, 1000, 130], [700, 65, 2000]
    r2t, k_buf, v_buf = _world([2048] * 3, b, h_kv, d, dtype)
    fi = FlashInferSparseDecode(h_kv, group, d, dtype, dtype, "cuda", max_rows=16, max_indices=1 << 14)
    seq = torch.zeros(3, dtype=torch.int64, device="cuda")
    sel = torch.full((3, h_kv, k_top), -1, dtype=torch.int32, device="cuda")
    q = torch.zeros(3, h_kv * group, d, device="cuda", dtype=dtype)
    rpi = torch.arange(3, device="cuda")
    indptr_dev = torch.zeros(3 * h_kv + 1, dtype=torch.int32, device="cuda")

    def load(lens, seed):
        seq.copy_(torch.tensor(lens))
        sel.copy_(_random_selection(lens, h_kv, k_top, b, seed))
        q.copy_(torch.randn(3, h_kv * group, d, dtype=dtype, generator=torch.Generator().manual_seed(seed)).cuda())
        host = kv_indptr_for(torch.tensor(lens), k_top, b, h_kv)
        indptr_dev.copy_(host)
        return fi.plan(host, d**-0.5, graph_bs=3)

    buf = load(lens_a, 1)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):  # warm up (JIT) outside the capture
        build_kv_indices_triton(sel, seq, r2t, rpi, b, indptr_dev, buf)
        fi.run(q, k_buf, v_buf)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        build_kv_indices_triton(sel, seq, r2t, rpi, b, indptr_dev, buf)
        out = fi.run(q, k_buf, v_buf)
    for lens, seed in ((lens_a, 1), (lens_b, 2)):
        load(lens, seed)  # host plan outside the graph, new data in the fixed buffers
        graph.replay()
        indptr, idx = build_kv_indices(sel, seq, r2t, rpi, b)
        ref = sparse_decode_attention(q, k_buf, v_buf, indptr, idx, scale=d**-0.5)
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
