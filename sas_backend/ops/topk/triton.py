"""Top-K block selection (Triton): a radix threshold select, not a sort, split over chunks.

Same output as `sas_backend.ops.topk.naive.select_blocks`. Two launches, so that a row as wide
as the server's maximum context occupies many programs even at batch 1:

Phase 1, grid `(bs, H_kv, chunks)`: program (r, h, c) holds the scores of blocks
`[c * CHUNK, (c + 1) * CHUNK)` of row (r, h) in registers and selects the chunk's local top
`S = min(K, CHUNK)` under the same total order as the final answer (key descending, block index
ascending). It writes their keys and block indices, in ascending block order and -1 padded, to
the workspace `[bs, H_kv, 2, chunks, S]`. Every block of the global top K is in its chunk's local
top K, so the row's answer is the top K of the `chunks * S` survivors. Programs whose chunk
starts at or past `num_candidates[r]` exit at once: the work follows the batch's longest request.
Phase 2, grid `(bs, H_kv)`: one program per row runs the same select over the first
`cdiv(num_candidates[r], CHUNK) * S` survivors (chunks laid out in order, so position order is
block order and "lower position" still means "lower block index") and writes the output.
When the whole row fits one chunk, phase 1 writes the output directly and phase 2 is skipped.

The select (both phases):
1. Each score becomes an order-preserving int32 key (NaN -> -inf, -0.0 -> +0.0). Forced
   blocks get keys above +inf: sink blocks the top key (ties -> lowest index first), local
   blocks one key each, larger for blocks nearer the current one.
2. The K-th largest key T is found MSB-first, 8 bits per pass (at most 4 passes): each pass
   histograms the next byte of the keys that share the bytes fixed so far and keeps the largest
   byte whose ">=" count still reaches K. When that count is exactly K the bucket is taken whole
   and the remaining passes are skipped (usually after 2 passes for continuous scores).
3. One more pass emits, in ascending block order, every key > T plus the lowest-index keys == T
   until K are taken; output positions come from running prefix counts (cumsum).

Rows (and chunks) with at most K candidates skip step 2 and emit all of them. No host syncs and
no shape depends on num_candidates: CUDA-graph capturable (pass `out` and `workspace`).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

# Key space (signed int32, order-preserving for fp32 bit patterns): -inf -> _NEG_INF_KEY,
# +inf -> 0x7F800000. NaN bit patterns are mapped away, so the keys above +inf are free for
# forced blocks: local blocks from _LOCAL_KEY_BASE up, sink blocks at _SINK_KEY.
_NEG_INF_KEY = tl.constexpr(-2139095041)  # int32(0xFF800000) ^ 0x7FFFFFFF
_LOCAL_KEY_BASE = tl.constexpr(0x7F800001)
_SINK_KEY = tl.constexpr(0x7FFFFFFF)
# INT32_MIN, score_keys, pad_slots, chunk_topk and merge_topk: this op's Triton building blocks, shared with the
# fused decode step's select.
INT32_MIN = tl.constexpr(-2147483648)  # the bits of -0.0; also a threshold below every key


@triton.jit
def _row_keys(row_ptr, idx, n, sink_blocks, local_blocks):
    """Order-preserving int32 keys of scores[idx] (idx < n valid), forced blocks on top."""
    valid = idx < n
    x = tl.load(row_ptr + idx, mask=valid, other=float("-inf")).to(tl.float32)
    return score_keys(x, idx, n, sink_blocks, local_blocks), valid


@triton.jit
def score_keys(x, idx, n, sink_blocks, local_blocks):
    """Order-preserving int32 keys of fp32 scores x at block indices idx (row of n candidates):
    NaN as -inf, -0.0 as +0.0, the `sink_blocks` first and `local_blocks` last blocks forced on top.
    Shared with the fused select kernel (`ops.fused_step.triton`)."""
    bits = x.to(tl.int32, bitcast=True)
    bits = tl.where(bits == INT32_MIN, 0, bits)  # -0.0 ties with +0.0, as in torch.sort
    is_nan = (bits & 0x7FFFFFFF) > 0x7F800000
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    key = tl.where(is_nan, _NEG_INF_KEY, key)  # NaN counts as -inf
    local_lo = n - local_blocks
    key = tl.where(idx >= local_lo, _LOCAL_KEY_BASE + (idx - local_lo), key)
    key = tl.where(idx < sink_blocks, _SINK_KEY, key)
    return key


@triton.jit
def _pass_hist(key, valid, p: tl.constexpr, prefix):
    """256-bin histogram of byte p (MSB first) of the keys whose higher bytes equal `prefix`."""
    shift = 24 - 8 * p  # p is a compile-time constant
    digit = (key >> shift) & 255
    if p == 0:
        digit = digit ^ 128  # signed top byte -> unsigned order
        match = valid
    else:
        match = valid & ((key >> (shift + 8)) == prefix)
    return tl.histogram(digit, 256, mask=match)


@triton.jit
def _pass_pick(hist, p: tl.constexpr, K, prefix, above, thresh, need_ties, done):
    """Fix byte p of the K-th largest key from the pass's histogram; returns the new state.

    prefix: the fixed high bytes of T (an arithmetic shift of T); above: keys already known to
    beat the prefix; done: set once a bucket held exactly the missing keys (thresh/need_ties final).
    """
    shift = 24 - 8 * p  # p is a compile-time constant
    bins = tl.arange(0, 256)
    # count_ge[d]: keys >= (prefix, d); non-increasing in d, count_ge[0] >= K.
    count_ge = above + tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist
    d_star = tl.sum((count_ge >= K).to(tl.int32), axis=0) - 1
    n_above = above + tl.sum(tl.where(bins > d_star, hist, 0), axis=0)
    n_ge = n_above + tl.sum(tl.where(bins == d_star, hist, 0), axis=0)
    if p == 0:
        new_prefix = d_star - 128
    else:
        new_prefix = prefix * 256 + d_star
    # Exactly K keys reach the chosen bucket: take all of them (every key >= the bucket's
    # lowest key) and skip the remaining passes. Typical for continuous scores.
    finish = (done == 0) & (n_ge == K)
    thresh = tl.where(finish, new_prefix * (1 << shift), thresh)
    need_ties = tl.where(finish, K, need_ties)
    prefix = tl.where(done != 0, prefix, new_prefix)
    above = tl.where(done != 0, above, n_above)
    done = done | finish.to(tl.int32)
    return prefix, above, thresh, need_ties, done


@triton.jit
def _tile_select(key, valid, thresh, need_ties, taken, ties):
    """Which entries of a tile are emitted (keys > T, then the first `need_ties` keys == T in
    position order) and their output positions; returns (sel, pos, new taken, new ties)."""
    eq = (valid & (key == thresh)).to(tl.int32)
    tie_rank = ties + tl.cumsum(eq, axis=0) - eq
    sel = (valid & (key > thresh)) | ((eq != 0) & (tie_rank < need_ties))
    sel_i = sel.to(tl.int32)
    pos = taken + tl.cumsum(sel_i, axis=0) - sel_i
    return sel, pos, taken + tl.sum(sel_i, axis=0), ties + tl.sum(eq, axis=0)


@triton.jit
def pad_slots(dst_ptr, count, SLOTS, SLOT_TILE: tl.constexpr):
    """-1 into dst[count:SLOTS]."""
    for s0 in range(0, SLOTS, SLOT_TILE):
        pos = s0 + tl.arange(0, SLOT_TILE)
        tl.store(dst_ptr + pos, tl.full([SLOT_TILE], -1, tl.int32), mask=(pos >= count) & (pos < SLOTS))


@triton.jit
def _chunk_select_kernel(
    scores_ptr,
    ncand_ptr,
    dst_ptr,
    stride_sb,
    stride_sh,
    stride_db,
    stride_dh,
    key_off,
    M,
    K,
    SLOTS,
    sink_blocks,
    local_blocks,
    CHUNK: tl.constexpr,
    SLOT_TILE: tl.constexpr,
    DIRECT: tl.constexpr,
):
    """Phase 1, program (r, h, c): local top min(K, SLOTS) of chunk c of row (r, h).

    DIRECT (a single chunk covers M): dst is the output `[bs, H_kv, K]` (SLOTS = K), row done.
    Otherwise dst is the workspace `[bs, H_kv, 2, chunks, SLOTS]` (stride_db/dh its row strides):
    block indices at row + key_off + c * SLOTS, keys at row + c * SLOTS.
    """
    r = tl.program_id(0)
    h = tl.program_id(1)
    c = tl.program_id(2)
    n = tl.minimum(tl.load(ncand_ptr + r).to(tl.int32), M)
    n = tl.maximum(n, 0)
    start = c * CHUNK
    # Chunks past the row's end do nothing (phase 2 never reads them). Chunk 0 always runs so
    # that an empty row still gets its -1 padding in DIRECT mode.
    if (c == 0) | (start < n):
        row_ptr = scores_ptr + r.to(tl.int64) * stride_sb + h.to(tl.int64) * stride_sh
        dst_row = dst_ptr + r.to(tl.int64) * stride_db + h.to(tl.int64) * stride_dh
        if DIRECT:
            idx_ptr = dst_row
        else:
            idx_ptr = dst_row + key_off + c * SLOTS
        key_ptr = dst_row + c * SLOTS  # only used when not DIRECT
        n_c = tl.minimum(tl.maximum(n - start, 0), CHUNK)
        pad_slots(idx_ptr, tl.minimum(n_c, K), SLOTS, SLOT_TILE)

        idx = start + tl.arange(0, CHUNK)
        key, valid = _row_keys(row_ptr, idx, n, sink_blocks, local_blocks)
        chunk_topk(key, valid, idx, n_c, K, idx_ptr, key_ptr, WRITE_KEYS=not DIRECT)


@triton.jit
def chunk_topk(key, valid, idx, n_c, K, idx_ptr, key_ptr, WRITE_KEYS: tl.constexpr):
    """The top min(K, n_c) of one tile held in registers (keys from `score_keys`, n_c valid entries) ->
    idx_ptr[0:] block indices in ascending block order (and key_ptr[0:] their keys if WRITE_KEYS).
    The caller pads the rest. Shared with the fused select kernel (`ops.fused_step.triton`)."""
    thresh = tl.full([], INT32_MIN, tl.int32)  # below every key: take all
    need_ties = tl.full([], 0, tl.int32)
    if n_c > K:
        # The tile sits in registers: every pass re-reads the same keys, no reloads.
        prefix = tl.full([], 0, tl.int32)
        above = tl.full([], 0, tl.int32)
        done = tl.full([], 0, tl.int32)
        for p in tl.static_range(4):
            hist = tl.zeros([256], dtype=tl.int32)
            if done == 0:
                hist = _pass_hist(key, valid, p, prefix)
            prefix, above, thresh, need_ties, done = _pass_pick(
                hist, p, K, prefix, above, thresh, need_ties, done
            )
        thresh = tl.where(done != 0, thresh, prefix)
        need_ties = tl.where(done != 0, need_ties, K - above)
    zero = tl.full([], 0, tl.int32)
    sel, pos, _, _ = _tile_select(key, valid, thresh, need_ties, zero, zero)
    tl.store(idx_ptr + pos, idx, mask=sel)
    if WRITE_KEYS:
        tl.store(key_ptr + pos, key, mask=sel)


@triton.jit
def _merge_select_kernel(
    ws_ptr,
    ncand_ptr,
    out_ptr,
    stride_wb,
    stride_wh,
    key_off,
    stride_ob,
    stride_oh,
    M,
    K,
    SLOTS,
    CHUNK: tl.constexpr,
    TILE: tl.constexpr,
    K_TILE: tl.constexpr,
):
    """Phase 2, program (r, h): top K of the row's chunk survivors in the workspace -> out."""
    r = tl.program_id(0)
    h = tl.program_id(1)
    key_row = ws_ptr + r.to(tl.int64) * stride_wb + h.to(tl.int64) * stride_wh
    idx_row = key_row + key_off
    o_ptr = out_ptr + r.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
    n = tl.minimum(tl.load(ncand_ptr + r).to(tl.int32), M)
    n = tl.maximum(n, 0)
    # Survivors of the chunks that hold candidates; -1 block index marks a padding slot.
    merge_topk(key_row, idx_row, o_ptr, n, K, ((n + CHUNK - 1) // CHUNK) * SLOTS, TILE, K_TILE, False)


@triton.jit
def merge_topk(key_row, idx_row, o_ptr, n, K, length, TILE: tl.constexpr, K_TILE: tl.constexpr,
               CG: tl.constexpr):
    """Top K of `length` chunk survivors (keys at key_row, block indices at idx_row, -1 = padding slot, in
    block order) of a row with n candidates -> o_ptr[0:K], ascending, -1 padded. CG: read the survivors
    through L2 only (another program of the same launch wrote them). Shared with `ops.fused_step.triton`."""
    pad_slots(o_ptr, tl.minimum(n, K), K, K_TILE)
    thresh = tl.full([], INT32_MIN, tl.int32)
    need_ties = tl.full([], 0, tl.int32)
    # n > K leaves at least K survivors (each chunk keeps min(its count, K)), so a K-th exists.
    if n > K:
        prefix = tl.full([], 0, tl.int32)
        above = tl.full([], 0, tl.int32)
        done = tl.full([], 0, tl.int32)
        for p in tl.static_range(4):
            hist = tl.zeros([256], dtype=tl.int32)
            for s0 in range(0, tl.where(done != 0, 0, length), TILE):
                j = s0 + tl.arange(0, TILE)
                blk, key = _load_survivors(key_row, idx_row, j, length, CG)
                hist += _pass_hist(key, blk >= 0, p, prefix)
            prefix, above, thresh, need_ties, done = _pass_pick(hist, p, K, prefix, above, thresh, need_ties, done)
        thresh = tl.where(done != 0, thresh, prefix)
        need_ties = tl.where(done != 0, need_ties, K - above)

    taken = tl.full([], 0, tl.int32)
    ties = tl.full([], 0, tl.int32)
    for s0 in range(0, length, TILE):
        j = s0 + tl.arange(0, TILE)
        blk, key = _load_survivors(key_row, idx_row, j, length, CG)
        sel, pos, taken, ties = _tile_select(key, blk >= 0, thresh, need_ties, taken, ties)
        tl.store(o_ptr + pos, blk, mask=sel)


@triton.jit
def _load_survivors(key_row, idx_row, j, length, CG: tl.constexpr):
    if CG:
        blk = tl.load(idx_row + j, mask=j < length, other=-1, cache_modifier=".cg")
        key = tl.load(key_row + j, mask=blk >= 0, other=0, cache_modifier=".cg")
    else:
        blk = tl.load(idx_row + j, mask=j < length, other=-1)
        key = tl.load(key_row + j, mask=blk >= 0, other=0)
    return blk, key


def _plan(m: int, k: int, chunk: Optional[int] = None) -> Tuple[int, int, int]:
    """(chunk width, chunks, survivor slots per chunk) for rows of width m and a given K.

    1024-wide chunks give 32 programs per row at M = 32768 while each chunk still sits in
    registers; wider for large K so that a chunk keeps at most ~1/4 of its blocks. `chunk`: a
    width to use instead (a power of two, 16-8192; any width gives the same answer), for tuning.
    """
    if chunk is not None:
        if chunk < 16 or chunk > 8192 or chunk & (chunk - 1):
            raise ValueError(f"chunk must be a power of two in 16..8192, got {chunk}")
    else:
        chunk = max(1024, 4 * triton.next_power_of_2(max(k, 1)))
    chunk = min(chunk, 8192, max(16, triton.next_power_of_2(max(m, 1))))
    chunks = triton.cdiv(max(m, 1), chunk)
    return chunk, chunks, min(k, chunk)


def topk_workspace_numel(bs: int, h_kv: int, m: int, k: int, chunk: Optional[int] = None) -> int:
    """int32 elements of the workspace `select_blocks_triton` needs for scores `[bs, H_kv, m]`
    (0 when one chunk covers m). Non-decreasing in every argument, so one buffer sized for the
    largest batch and width serves all smaller calls with the same K (and chunk)."""
    if k <= 0:
        return 0
    _, chunks, slots = _plan(m, k, chunk)
    return 0 if chunks == 1 else bs * h_kv * 2 * chunks * slots


def select_blocks_triton(
    scores: torch.Tensor, num_candidates: torch.Tensor, k: int, sink_blocks: int = 0, local_blocks: int = 0,
    out: Optional[torch.Tensor] = None, workspace: Optional[torch.Tensor] = None, chunk: Optional[int] = None,
) -> torch.Tensor:
    """`ops.topk.select_blocks` on CUDA (its docstring has the shapes and the rule).

    Kernel terms: scores last axis contiguous (other dtypes are cast to fp32), entries at m >= num_candidates[r]
    never read; num_candidates on device; out last axis contiguous. workspace: optional contiguous int32 scratch
    of at least `topk_workspace_numel(bs, H_kv, M, K)` elements (allocated once by the caller, e.g. for CUDA
    graphs); allocated per call when absent and needed. chunk: phase 1's chunk width instead of the default
    (`_plan`; for tuning: the answer does not depend on it)."""
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
    chunk, chunks, slots = _plan(m, k, chunk)
    direct = chunks == 1
    need = topk_workspace_numel(bs, h_kv, m, k, chunk)
    if direct:
        ws = out  # unused placeholder
    elif workspace is None:
        ws = torch.empty(need, dtype=torch.int32, device=scores.device)
    elif workspace.dtype != torch.int32 or not workspace.is_contiguous() or workspace.numel() < need:
        raise ValueError(f"workspace must be contiguous int32 with at least {need} elements")
    else:
        ws = workspace
    # Workspace view [bs, H_kv, 2, chunks, slots]: keys then block indices, per row.
    row_stride = 2 * chunks * slots
    key_off = chunks * slots
    # Clamped so forced keys stay inside their key range.
    sink = min(max(sink_blocks, 0), m)
    local = min(max(local_blocks, 0), m)
    dst_slots = k if direct else slots
    slot_tile = max(16, min(1024, triton.next_power_of_2(dst_slots)))
    _chunk_select_kernel[(bs, h_kv, chunks)](
        scores,
        num_candidates,
        out if direct else ws,
        scores.stride(0),
        scores.stride(1),
        out.stride(0) if direct else h_kv * row_stride,
        out.stride(1) if direct else row_stride,
        key_off,
        m,
        k,
        dst_slots,
        sink,
        local,
        CHUNK=chunk,
        SLOT_TILE=slot_tile,
        DIRECT=direct,
        num_warps=8 if chunk >= 2048 else 4,
    )
    if not direct:
        # Survivors per row: at most 32 chunks * slots at M = 32768, K <= 256.
        tile = max(16, min(4096, triton.next_power_of_2(chunks * slots)))
        _merge_select_kernel[(bs, h_kv)](
            ws,
            num_candidates,
            out,
            h_kv * row_stride,
            row_stride,
            key_off,
            out.stride(0),
            out.stride(1),
            m,
            k,
            slots,
            CHUNK=chunk,
            TILE=tile,
            K_TILE=max(16, min(1024, triton.next_power_of_2(k))),
            num_warps=8 if tile >= 2048 else 4,
        )
    return out
