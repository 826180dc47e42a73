"""summarize_pages_triton / summary_update_decode_triton vs the plain-torch references."""

import pytest
import torch

from sas_backend.ops.rope import apply_rope, rope_cos_sin_table
from sas_backend.ops.summary.torch_path import summarize_blocks, summarize_pages
from sas_backend.ops.summary.naive import summary_update_decode
from sas_backend.ops.summary.triton import summarize_pages_triton, summary_update_decode_triton
from tests.devices import DEVICE

MAX_POS = 1024


def _gate_params(h_kv, d, dg, w_dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    w_k = (torch.randn(h_kv, 3 * d, dg, generator=g) / (3 * d) ** 0.5).to(DEVICE, w_dtype)
    k_norm = (torch.rand(dg, generator=g) + 0.5).to(DEVICE, w_dtype)
    model_cs = rope_cos_sin_table(d, MAX_POS, 10000.0, device=DEVICE)
    gate_cs = rope_cos_sin_table(dg, MAX_POS, 500000.0, device=DEVICE)
    return model_cs, gate_cs, w_k, k_norm


def _post_rope_cache(num_pages, b, h_kv, d, page_starts, model_cs, dtype, seed=0):
    """k_buffer `[(num_pages+1)*b, H, D]` whose page p holds a block starting at page_starts[p]."""
    g = torch.Generator().manual_seed(seed)
    k_pre = (torch.randn((num_pages + 1) * b, h_kv, d, generator=g) * 2 + 0.3).to(DEVICE)
    pos = (page_starts[:, None] + torch.arange(b, device=DEVICE)[None, :]).reshape(-1)
    return apply_rope(k_pre, model_cs[pos]).to(dtype), k_pre


@pytest.mark.parametrize("h_kv,d,dg", [(1, 16, 16), (3, 24, 32), (2, 32, 16)])
@pytest.mark.parametrize("block_size", [4, 8])
def test_summarize_pages(h_kv, d, dg, block_size):
    b, num_pages = block_size, 24
    g = torch.Generator().manual_seed(h_kv * d)
    page_starts = (torch.randint(0, MAX_POS // b - 1, (num_pages + 1,), generator=g) * b).to(DEVICE)
    model_cs, gate_cs, w_k, k_norm = _gate_params(h_kv, d, dg, seed=d)
    k_buf, k_pre = _post_rope_cache(num_pages, b, h_kv, d, page_starts, model_cs, torch.float32)
    pages = (torch.randperm(num_pages, generator=g)[:19] + 1).to(DEVICE)  # more than one 16-block tile
    starts = page_starts[pages]
    args = (k_buf, pages, starts, model_cs, gate_cs, w_k, k_norm, b)
    ref = summarize_pages(*args)
    out = summarize_pages_triton(*args)
    assert out.dtype == torch.float32 and out.shape == (19, h_kv, dg)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    # Undoing the model's RoPE recovers the pre-RoPE keys the gate was trained on.
    blocks_pre = k_pre.reshape(num_pages + 1, b, h_kv, d)[pages]
    direct = summarize_blocks(blocks_pre, w_k, k_norm, gate_cs[starts])
    torch.testing.assert_close(out, direct, rtol=1e-4, atol=1e-4)


def test_summarize_pages_scaled_table_like_yarn():
    """A table carrying a magnitude (YaRN's mscale) is undone exactly, as the reference does."""
    b, h_kv, d, dg, num_pages = 8, 2, 16, 16, 6
    page_starts = torch.arange(num_pages + 1, device=DEVICE) * b
    model_cs, gate_cs, w_k, k_norm = _gate_params(h_kv, d, dg, seed=2)
    model_cs = model_cs * 1.3
    k_buf, k_pre = _post_rope_cache(num_pages, b, h_kv, d, page_starts, model_cs, torch.float32, seed=2)
    pages = torch.tensor([2, 5, 1], device=DEVICE)
    out = summarize_pages_triton(k_buf, pages, page_starts[pages], model_cs, gate_cs, w_k, k_norm, b)
    blocks_pre = k_pre.reshape(num_pages + 1, b, h_kv, d)[pages]
    direct = summarize_blocks(blocks_pre, w_k, k_norm, gate_cs[page_starts[pages]])
    torch.testing.assert_close(out, direct, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k_dtype", [torch.bfloat16])
def test_summarize_pages_bf16(k_dtype, w_dtype):
    b, h_kv, d, dg, num_pages = 8, 2, 16, 16, 10
    page_starts = torch.arange(num_pages + 1, device=DEVICE) * b
    model_cs, gate_cs, w_k, k_norm = _gate_params(h_kv, d, dg, w_dtype, seed=1)
    k_buf, _ = _post_rope_cache(num_pages, b, h_kv, d, page_starts, model_cs.to(k_dtype), k_dtype, seed=1)
    pages = torch.tensor([3, 1, 7, 10], device=DEVICE)
    args = (k_buf, pages, page_starts[pages], model_cs.to(k_dtype), gate_cs, w_k, k_norm, b)
    torch.testing.assert_close(summarize_pages_triton(*args), summarize_pages(*args), rtol=1e-4, atol=1e-5)


def test_summarize_pages_block_size_64():
    b, h_kv, d, dg, num_pages = 64, 2, 16, 32, 4
    page_starts = torch.tensor([0, 128, 0, 640, 64], device=DEVICE)
    model_cs, gate_cs, w_k, k_norm = _gate_params(h_kv, d, dg, seed=2)
    k_buf, _ = _post_rope_cache(num_pages, b, h_kv, d, page_starts, model_cs, torch.float32, seed=2)
    pages = torch.tensor([1, 3, 4], device=DEVICE)
    args = (k_buf, pages, page_starts[pages], model_cs, gate_cs, w_k, k_norm, b)
    torch.testing.assert_close(summarize_pages_triton(*args), summarize_pages(*args), rtol=1e-4, atol=1e-5)


def test_summarize_pages_empty():
    model_cs, gate_cs, w_k, k_norm = _gate_params(2, 16, 16)
    k_buf = torch.randn(32, 2, 16, device=DEVICE)
    empty = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    assert summarize_pages_triton(k_buf, empty, empty, model_cs, gate_cs, w_k, k_norm, 4).shape == (0, 2, 16)


def _decode_case(paged_case, lens, b, h_kv, d, dg, k_dtype, seed):
    case = paged_case(lens, b, h_kv, d, seed=seed)
    model_cs, gate_cs, w_k, k_norm = _gate_params(h_kv, d, dg, seed=seed)
    # Post-RoPE keys at the positions each slot holds (garbage slots: position 0).
    slot_pos = torch.zeros(case.slots, dtype=torch.int64, device=DEVICE)
    for r, n in enumerate(lens):
        slots = case.req_to_token[int(case.req_pool_indices[r]), :n].long()
        slot_pos[slots] = torch.arange(n, device=DEVICE)
    k_pre = case.randn(case.slots, h_kv, d)
    k_buf = apply_rope(k_pre, model_cs[slot_pos]).to(k_dtype)
    return case, (model_cs, gate_cs, w_k, k_norm), k_buf


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [4, 8])
def test_summary_update_decode(paged_case, block_size, out_dtype):
    b, h_kv, d, dg = block_size, 2, 16, 16
    # Completing a block: b, 3b, 5b (incl. a shared prefix page); not completing: 0, 1, b+1, 3b-1
    lens = [b, 3 * b, 1, b + 1, 3 * b - 1, 5 * b, 0]
    case, (mcs, gcs, w_k, k_norm), k_buf = _decode_case(paged_case, lens, b, h_kv, d, dg, torch.float32, b)
    init = case.randn(case.num_pages + 1, h_kv, dg).to(out_dtype)
    ref, out = init.clone(), init.clone()
    common = (case.block_table(), case.seq_lens, b, mcs, gcs, w_k, k_norm)
    summary_update_decode(k_buf, ref, *common)
    res = summary_update_decode_triton(k_buf, out, *common)
    assert res is out
    written = (ref != init).any(-1).any(-1)
    assert int(written.sum()) == 3 and not written[0]  # three completed blocks, padding row untouched
    assert torch.equal(out[~written], init[~written])  # other rows untouched
    tol = dict(rtol=1e-4, atol=1e-5) if out_dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(out.float(), ref.float(), **tol)


def test_summary_update_decode_bf16_keys_many_requests(paged_case):
    # 20 requests: more than one 16-request tile; bf16 cache.
    b, h_kv, d, dg = 4, 3, 16, 32
    lens = [4 * (i % 5) + (i % 3 == 0) for i in range(20)]
    case, (mcs, gcs, w_k, k_norm), k_buf = _decode_case(paged_case, lens, b, h_kv, d, dg, torch.bfloat16, 21)
    init = torch.zeros(case.num_pages + 1, h_kv, dg, device=DEVICE)
    ref, out = init.clone(), init.clone()
    common = (case.block_table(), case.seq_lens, b, mcs, gcs, w_k, k_norm)
    summary_update_decode(k_buf, ref, *common)
    summary_update_decode_triton(k_buf, out, *common)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def test_summary_update_decode_block_size_64(paged_case):
    b, h_kv, d, dg = 64, 1, 16, 16
    lens = [64, 65, 128, 1]
    case, (mcs, gcs, w_k, k_norm), k_buf = _decode_case(paged_case, lens, b, h_kv, d, dg, torch.float32, 64)
    init = torch.zeros(case.num_pages + 1, h_kv, dg, device=DEVICE)
    ref, out = init.clone(), init.clone()
    common = (case.block_table(), case.seq_lens, b, mcs, gcs, w_k, k_norm)
    summary_update_decode(k_buf, ref, *common)
    summary_update_decode_triton(k_buf, out, *common)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
