"""Top-K block selection (Triton): a radix threshold select, not a sort.

Same output as `sas_backend.ops.topk.naive.select_blocks`. One program per (request, kv head)
streams the row's first `num_candidates[r]` scores in chunks (the row never has to fit in
registers):

1. Each score becomes an order-preserving int32 key (NaN -> -inf, -0.0 -> +0.0). Forced
   blocks get keys above +inf: sink blocks the top key (ties -> lowest index first), local
   blocks one key each, larger for blocks nearer the current one.
2. The K-th largest key T is found MSB-first, 8 bits per pass (at most 4 passes): each pass
   histograms the next byte of the keys that share the bytes fixed so far and keeps the largest
   byte whose ">=" count still reaches K. When that count is exactly K the bucket is taken whole
   and the remaining passes are skipped (usually after 2 passes for continuous scores).
3. One more pass emits, in ascending block order, every key > T plus the lowest-index keys == T
   until K are taken; output positions come from running prefix counts (cumsum).

Rows with at most K candidates skip step 2 and emit all of them. No host syncs: capturable.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

# Key space (signed int32, order-preserving for fp32 bit patterns): -inf -> _NEG_INF_KEY,
# +inf -> 0x7F800000. NaN bit patterns are mapped away, so the keys above +inf are free for
# forced blocks: local blocks from _LOCAL_KEY_BASE up, sink blocks at _SINK_KEY.
_NEG_INF_KEY = tl.constexpr(-2139095041)  # int32(0xFF800000) ^ 0x7FFFFFFF
_LOCAL_KEY_BASE = tl.constexpr(0x7F800001)
_SINK_KEY = tl.constexpr(0x7FFFFFFF)
_INT32_MIN = tl.constexpr(-2147483648)  # the bits of -0.0; also a threshold below every key


@triton.jit
def _row_keys(row_ptr, idx, n, sink_blocks, local_blocks):
    """Order-preserving int32 keys of scores[idx] (idx < n valid), forced blocks on top."""
    valid = idx < n
    x = tl.load(row_ptr + idx, mask=valid, other=float("-inf")).to(tl.float32)
    bits = x.to(tl.int32, bitcast=True)
    bits = tl.where(bits == _INT32_MIN, 0, bits)  # -0.0 ties with +0.0, as in torch.sort
    is_nan = (bits & 0x7FFFFFFF) > 0x7F800000
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    key = tl.where(is_nan, _NEG_INF_KEY, key)  # NaN counts as -inf
    local_lo = n - local_blocks
    key = tl.where(idx >= local_lo, _LOCAL_KEY_BASE + (idx - local_lo), key)
    key = tl.where(idx < sink_blocks, _SINK_KEY, key)
    return key, valid


@triton.jit
def _select_blocks_kernel(
    scores_ptr,
    ncand_ptr,
    out_ptr,
    stride_sb,
    stride_sh,
    stride_ob,
    stride_oh,
    M,
    K,
    sink_blocks,
    local_blocks,
    CHUNK: tl.constexpr,
    K_CHUNK: tl.constexpr,
):
    r = tl.program_id(0)
    h = tl.program_id(1)
    row_ptr = scores_ptr + r.to(tl.int64) * stride_sb + h.to(tl.int64) * stride_sh
    o_ptr = out_ptr + r.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
    n = tl.minimum(tl.load(ncand_ptr + r).to(tl.int32), M)
    n = tl.maximum(n, 0)
    count = tl.minimum(n, K)

    # -1 padding behind the `count` selected entries.
    for k0 in range(0, K, K_CHUNK):
        pos = k0 + tl.arange(0, K_CHUNK)
        tl.store(o_ptr + pos, tl.full([K_CHUNK], -1, tl.int32), mask=(pos >= count) & (pos < K))

    thresh = tl.full([], _INT32_MIN, tl.int32)  # below every key: take all candidates
    need_ties = tl.full([], 0, tl.int32)
    if n > K:
        bins = tl.arange(0, 256)
        above = tl.full([], 0, tl.int32)  # keys whose already-fixed bytes beat the prefix
        prefix = tl.full([], 0, tl.int32)  # fixed high bytes of T, as an arithmetic shift of T
        done = tl.full([], 0, tl.int32)
        for p in tl.static_range(4):
            shift = 24 - 8 * p  # p is a compile-time constant
            hist = tl.zeros([256], dtype=tl.int32)
            for start in range(0, tl.where(done != 0, 0, n), CHUNK):
                idx = start + tl.arange(0, CHUNK)
                key, valid = _row_keys(row_ptr, idx, n, sink_blocks, local_blocks)
                digit = (key >> shift) & 255
                if p == 0:
                    digit = digit ^ 128  # signed top byte -> unsigned order
                    match = valid
                else:
                    match = valid & ((key >> (shift + 8)) == prefix)
                hist += tl.histogram(digit, 256, mask=match)
            # count_ge[d]: keys >= (prefix, d); non-increasing in d, count_ge[0] >= K.
            count_ge = above + tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist
            d_star = tl.sum((count_ge >= K).to(tl.int32), axis=0) - 1
            n_above = above + tl.sum(tl.where(bins > d_star, hist, 0), axis=0)
            n_ge = n_above + tl.sum(tl.where(bins == d_star, hist, 0), axis=0)
            if p == 0:
                new_prefix = d_star - 128
            else:
                new_prefix = prefix * 256 + d_star
            # Exactly K keys reach the chosen bucket: take all of them (every key >= the
            # bucket's lowest key) and skip the remaining passes. Typical for continuous scores.
            finish = (done == 0) & (n_ge == K)
            thresh = tl.where(finish, new_prefix * (1 << shift), thresh)
            need_ties = tl.where(finish, K, need_ties)
            prefix = tl.where(done != 0, prefix, new_prefix)
            above = tl.where(done != 0, above, n_above)
            done = done | finish.to(tl.int32)
        thresh = tl.where(done != 0, thresh, prefix)
        need_ties = tl.where(done != 0, need_ties, K - above)

    # Emit in ascending block order: keys > T, then the lowest-index keys == T.
    taken = tl.full([], 0, tl.int32)
    ties = tl.full([], 0, tl.int32)
    for start in range(0, n, CHUNK):
        idx = start + tl.arange(0, CHUNK)
        key, valid = _row_keys(row_ptr, idx, n, sink_blocks, local_blocks)
        eq = (valid & (key == thresh)).to(tl.int32)
        tie_rank = ties + tl.cumsum(eq, axis=0) - eq
        sel = (valid & (key > thresh)) | ((eq != 0) & (tie_rank < need_ties))
        sel_i = sel.to(tl.int32)
        pos = taken + tl.cumsum(sel_i, axis=0) - sel_i
        tl.store(o_ptr + pos, idx, mask=sel)
        taken += tl.sum(sel_i, axis=0)
        ties += tl.sum(eq, axis=0)


def select_blocks_triton(
    scores: torch.Tensor,
    num_candidates: torch.Tensor,
    k: int,
    sink_blocks: int = 0,
    local_blocks: int = 0,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Pick K candidate blocks per (request, kv head) (Triton; same result as `select_blocks`).

    scores: `[bs, H_kv, M]` fp32 (last axis contiguous; other dtypes are cast to fp32);
    entries at m >= num_candidates[r] are never read. num_candidates: `[bs]` int (on device).
    Forced blocks count inside K: sink blocks first (lowest index first), then local blocks
    nearest the current block first; the rest by score, ties to the lower block index,
    NaN as -inf. A request with at most K candidates gets all of them.
    out: optional preallocated `[bs, H_kv, K]` int32 (last axis contiguous) for CUDA graphs.
    Returns `[bs, H_kv, K]` int32 logical block indices in ascending order, padded with -1.
    """
    bs, h_kv, m = scores.shape
    if out is None:
        out = torch.empty(bs, h_kv, max(k, 0), dtype=torch.int32, device=scores.device)
    elif out.shape != (bs, h_kv, max(k, 0)) or out.dtype != torch.int32 or out.stride(-1) != 1:
        raise ValueError("out must be [bs, H_kv, K] int32 with a contiguous last axis")
    if k <= 0 or bs == 0 or h_kv == 0:
        return out
    if scores.dtype != torch.float32:
        scores = scores.float()
    if scores.stride(-1) != 1:
        scores = scores.contiguous()
    if num_candidates.dtype not in (torch.int32, torch.int64):
        num_candidates = num_candidates.to(torch.int64)
    # 4096-wide chunks keep a pass over M=32768 at 8 steps while staying in registers.
    chunk = max(16, min(4096, triton.next_power_of_2(max(m, 1))))
    k_chunk = max(16, min(1024, triton.next_power_of_2(k)))
    _select_blocks_kernel[(bs, h_kv)](
        scores,
        num_candidates,
        out,
        scores.stride(0),
        scores.stride(1),
        out.stride(0),
        out.stride(1),
        m,
        k,
        min(max(sink_blocks, 0), m),  # clamped so forced keys stay inside their key range
        min(max(local_blocks, 0), m),
        CHUNK=chunk,
        K_CHUNK=k_chunk,
        num_warps=8 if chunk >= 2048 else 4,
    )
    return out
