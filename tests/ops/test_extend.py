"""The CPU extend (ops/extend): the new queries only, against the plain statement and against SGLang's
own torch-native extend, which it replaces in the `sas` backend on CPU. Both methods: "blocks"
(position-aligned query blocks merged by log-sum-exp: the default where torch has the CPU flash op) and
"mask" (the fallback: chunks of queries under a boolean mask); and what "blocks" promises beyond
closeness: a token's output is bit-identical however its prompt's extend was split."""

import pytest
import torch

from sas_backend.ops.extend import DEFAULT_METHOD, extend_attention_torch, paged_extend_attention
from sas_backend.ops.extend.naive import extend_attention_naive

TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2}


def _qkv(e, p, h_q, h_kv, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(e, h_q, d, generator=g).to(dtype)
    k = torch.randn(p + e, h_kv, d, generator=g).to(dtype)
    v = torch.randn(p + e, h_kv, d, generator=g).to(dtype)
    return q, k, v


# (extend, prefix, mask cap): a fresh prefill, a cached prefix, one token (a decode-like extend),
# chunks that end mid-way (cap forcing chunks of 7 or 3 queries), the whole extend in one chunk.
SHAPES = [(50, 0, 1 << 25), (33, 70, 1 << 25), (1, 129, 1 << 25), (64, 64, 7 * 128), (45, 0, 3 * 45),
          (100, 200, 1)]


def test_default_method_is_blocks_on_this_torch():
    assert DEFAULT_METHOD == "blocks"  # the venv's torch has the CPU flash op; "mask" is for others


@pytest.mark.parametrize("method", ["blocks", "mask"])
@pytest.mark.parametrize("e,p,cap", SHAPES)
@pytest.mark.parametrize("group", [1, 2, 3, 4, 7, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_equals_reference(e, p, cap, group, dtype, method):
    h_kv = 2
    q, k, v = _qkv(e, p, h_kv * group, h_kv, 32, dtype, seed=e + p + group)
    got = extend_attention_torch(q, k, v, p, 0.17, max_mask_elems=cap, method=method, block=16)
    want = extend_attention_naive(q, k, v, p, 0.17)
    assert got.dtype == dtype and got.shape == (e, h_kv * group, 32)
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


def test_length_mismatch_is_refused():
    q, k, v = _qkv(4, 10, 2, 1, 8, torch.float32, 0)
    with pytest.raises(ValueError, match="expected prefix 9"):
        extend_attention_torch(q, k, v, 9, 1.0)
    with pytest.raises(ValueError, match="expected prefix 9"):
        extend_attention_naive(q, k, v, 9, 1.0)
    with pytest.raises(ValueError, match="method"):
        extend_attention_torch(q, k, v, 10, 1.0, method="fast")


def _paged_batch(prefix_lens, extend_lens, h_q, h_kv, d, dtype, seed=0):
    """A batch of extends over a scrambled paged pool (slots at random, req rows not the identity)."""
    g = torch.Generator().manual_seed(seed)
    totals = [p + e for p, e in zip(prefix_lens, extend_lens)]
    slots = sum(totals) + 17
    k_cache = torch.randn(slots, h_kv, d, generator=g).to(dtype)
    v_cache = torch.randn(slots, h_kv, d, generator=g).to(dtype)
    max_reqs = len(totals) + 2
    req_to_token = torch.randint(0, slots, (max_reqs, max(totals) + 5), generator=g, dtype=torch.int32)
    perm = torch.randperm(slots, generator=g).int()
    rows = torch.randperm(max_reqs, generator=g)[: len(totals)]
    used = 0
    for r, t in zip(rows.tolist(), totals):
        req_to_token[r, :t] = perm[used : used + t]
        used += t
    q = torch.randn(sum(extend_lens), h_q, d, generator=g).to(dtype)
    return q, k_cache, v_cache, req_to_token, rows


@pytest.mark.parametrize("method", ["blocks", "mask"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_batch_equals_reference_and_sglang_torch_native(dtype, method):
    prefix_lens, extend_lens = [0, 130, 64, 7, 300], [77, 1, 64, 0, 41]  # mixed, one empty extend
    h_q, h_kv, d = 14, 2, 64
    q, k_cache, v_cache, r2t, rows = _paged_batch(prefix_lens, extend_lens, h_q, h_kv, d, dtype)
    out = torch.full_like(q, float("nan"))
    paged_extend_attention(q, out, k_cache, v_cache, r2t, rows.tolist(), prefix_lens, extend_lens, 0.125,
                           max_mask_elems=2000, method=method)
    start = 0
    for r, p, e in zip(rows.tolist(), prefix_lens, extend_lens):
        s = r2t[r, : p + e].long()
        want = extend_attention_naive(q[start : start + e], k_cache[s], v_cache[s], p, 0.125)
        torch.testing.assert_close(out[start : start + e].float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])
        start += e

    # What it replaces: SGLang's torch-native extend (queries padded to each request's whole length).
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    theirs = torch.empty_like(q)
    TorchNativeAttnBackend._run_sdpa_forward_extend(
        None, q, theirs, k_cache, v_cache, r2t, rows, torch.tensor([p + e for p, e in zip(prefix_lens, extend_lens)]),
        torch.tensor(prefix_lens), torch.tensor(extend_lens), scaling=0.125, enable_gqa=True, causal=True,
    )
    torch.testing.assert_close(out.float(), theirs.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("method", ["blocks", "mask"])
def test_lower_precision_kv_is_read_up(method):
    q, k, v = _qkv(20, 45, 6, 2, 16, torch.float32, 3)
    k16, v16 = k.bfloat16(), v.bfloat16()
    got = extend_attention_torch(q, k16, v16, 45, 0.25, method=method)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, extend_attention_naive(q, k16.float(), v16.float(), 45, 0.25), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [3, 7])
def test_blocks_are_bit_identical_however_the_extend_is_split(dtype, group):
    """One prompt whole, in page-aligned chunks (chunked prefill), after radix hits: every token's output
    equal to the bit, so a greedy answer does not change with the cache. SGLang's extends start on a
    page (its radix cache matches whole pages, chunk sizes are page multiples); a split mid-page is only
    close (the reference tests), as the last partial block's query count then differs."""
    n, h_kv = 700, 2
    q, k, v = _qkv(n, 0, h_kv * group, h_kv, 64, dtype, seed=group)
    splits = {
        "chunks of 256": [(s, min(256, n - s)) for s in range(0, n, 256)],
        "chunks of 64": [(s, min(64, n - s)) for s in range(0, n, 64)],
        "radix hit at 640": [(0, 640), (640, 60)],
        "radix hit at 128, then chunks of 192": [(0, 128)] + [(s, min(192, n - s)) for s in range(128, n, 192)],
    }
    whole = extend_attention_torch(q, k, v, 0, 0.125)
    for name, parts in splits.items():
        got = torch.cat([extend_attention_torch(q[p : p + e], k[: p + e], v[: p + e], p, 0.125) for p, e in parts])
        assert torch.equal(got, whole), name
