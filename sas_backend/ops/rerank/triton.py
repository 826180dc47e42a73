"""The exact second level as ONE Triton launch, grid `(bs, H_kv, SPLITS)`.

Split s reads first-level entries `[s * PER, (s + 1) * PER)` of its (row, kv head): each block's keys through the
block table (token o of block m at slot `block_table[r, m] + o`, one `[b, D]` tile; fp32 keys in 16-token tiles with
an online log-sum-exp), the kv group's G query heads
as one `tl.dot` tile (padded to 16 rows), and writes the block's log-sum-exp per query head to the workspace. The
last split to arrive (`ops.fused_step.triton._arrive`) normalizes each head over the row's blocks, takes the max
over the group, raises forced blocks (sink / local by `score_keys`, prompt anchors by +inf) and keeps the top K of
the tile in registers with the radix select the other selections use (`ops.topk.triton.chunk_topk`): ascending
block ids, -1 padded. Splits depend on the batch size only (a CUDA-graph replay launches the same grid). With one
split (a batch whose rows fill the device alone) the program keeps its log-sum-exps in registers: no workspace, fence
or atomic, so the workspace is sized for the small batches only. PACKED reads a block's keys from its page's 4-bit codes
(`ops.key_codes`) instead: q.k = q.lo + (q * step).code, the codes unpacked to fp32 tiles of RoPE's two halves
(two IEEE dots a token tile).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sas_backend.ops.fused_step import LaunchOptions, _interpreting, _pow2, anchor_launch_args
from sas_backend.ops.fused_step.triton import _after_predecessor, _arrive, candidate_keys
from sas_backend.ops.topk.triton import chunk_topk, pad_slots


@triton.jit
def _rerank_kernel(
    q_ptr, k_ptr, first_ptr, bt_ptr, ncand_ptr, anc_ptr, arows_ptr, out_ptr, lse_ptr, cnt_ptr, codes_ptr, cs_ptr,
    stride_qn, stride_qh, stride_ks, stride_kh, stride_fb, stride_fh, stride_bt, stride_ab, stride_ah,
    stride_ob, stride_oh, stride_cp, stride_ch, stride_sp, stride_sh,
    H_KV, G, C, K, SPLITS, PER, sink_blocks, local_blocks, R, scale,
    ANCHOR_ROWS: tl.constexpr, D: tl.constexpr, BLOCK_SIZE: tl.constexpr, TOK_TILE: tl.constexpr, GP: tl.constexpr,
    BLOCK_D: tl.constexpr, CP: tl.constexpr, K_TILE: tl.constexpr, IEEE: tl.constexpr, DOT_F32: tl.constexpr,
    PDL: tl.constexpr, ONE_SPLIT: tl.constexpr, PACKED: tl.constexpr, BLOCK_HD: tl.constexpr,
    LSE_ONLY: tl.constexpr = False,
):
    _after_predecessor(PDL)
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.program_id(2)
    g = tl.arange(0, GP)
    gm = g < G
    d = tl.arange(0, BLOCK_D)
    q = tl.load(q_ptr + r * stride_qn + (h * G + g)[:, None] * stride_qh + d[None, :],
                mask=gm[:, None] & (d < D)[None, :], other=0.0)
    if DOT_F32:  # Triton's interpreter computes bf16 tl.dot wrongly: fp32 on CPU (as `ops.fused_step.attend`)
        q = q.to(tl.float32)
    j = tl.arange(0, BLOCK_HD)
    jm = j < D // 2
    if PACKED:  # the query's two halves, fp32: byte j of the codes holds channel j and j + D / 2
        q_row = q_ptr + r * stride_qn + (h * G + g)[:, None] * stride_qh
        q_lo_half = tl.load(q_row + j[None, :], mask=gm[:, None] & jm[None, :], other=0.0).to(tl.float32)
        q_hi_half = tl.load(q_row + j[None, :] + D // 2, mask=gm[:, None] & jm[None, :], other=0.0).to(tl.float32)
    row_h = r * H_KV + h
    lse_row = lse_ptr + row_h * (CP * GP)
    first_row = first_ptr + r * stride_fb + h * stride_fh
    lo = s * PER
    hi = tl.minimum(lo + PER, C)
    c = tl.arange(0, CP)
    tile = tl.full([CP, GP], float("-inf"), tl.float32)  # ONE_SPLIT: the row's block log-sum-exps, in registers
    for e in range(lo, hi):
        blk = tl.load(first_row + e).to(tl.int64)
        lse = tl.full([GP], float("-inf"), tl.float32)
        if PACKED:
            if blk >= 0:
                # 4-bit codes (`ops.key_codes`): key = lo + step * code per channel, so q.k = q.lo + (q * step).code
                page = tl.load(bt_ptr + r * stride_bt + blk).to(tl.int64) // BLOCK_SIZE
                sc = cs_ptr + page * stride_sp + h * stride_sh + j
                lo_a = tl.load(sc, mask=jm, other=0.0).to(tl.float32)
                lo_b = tl.load(sc + D // 2, mask=jm, other=0.0).to(tl.float32)
                st_a = tl.load(sc + D, mask=jm, other=0.0).to(tl.float32)
                st_b = tl.load(sc + D + D // 2, mask=jm, other=0.0).to(tl.float32)
                bias = tl.sum(q_lo_half * lo_a[None, :], axis=1) + tl.sum(q_hi_half * lo_b[None, :], axis=1)  # [GP]
                qs_a = q_lo_half * st_a[None, :]
                qs_b = q_hi_half * st_b[None, :]
                m_i = tl.full([GP], float("-inf"), tl.float32)
                l_i = tl.zeros([GP], tl.float32)
                for t0 in range(0, BLOCK_SIZE, TOK_TILE):
                    t = t0 + tl.arange(0, TOK_TILE)
                    byte = tl.load(codes_ptr + page * stride_cp + h * stride_ch + t[:, None] * (D // 2) + j[None, :],
                                   mask=jm[None, :], other=0).to(tl.int32)
                    c_a = (byte & 15).to(tl.float32)
                    c_b = (byte >> 4).to(tl.float32)
                    qk = tl.dot(qs_a, tl.trans(c_a), input_precision="ieee") \
                        + tl.dot(qs_b, tl.trans(c_b), input_precision="ieee")
                    qk = (qk + bias[:, None]) * scale
                    m_new = tl.maximum(m_i, tl.max(qk, axis=1))
                    l_i = l_i * tl.exp(m_i - m_new) + tl.sum(tl.exp(qk - m_new[:, None]), axis=1)
                    m_i = m_new
                lse = m_i + tl.log(l_i)
        else:
            if blk >= 0:
                slot0 = tl.load(bt_ptr + r * stride_bt + blk).to(tl.int64)
                m_i = tl.full([GP], float("-inf"), tl.float32)
                l_i = tl.zeros([GP], tl.float32)
                # the block in token tiles (TOK_TILE < BLOCK_SIZE only for fp32 keys, whose dots need the registers)
                for t0 in range(0, BLOCK_SIZE, TOK_TILE):
                    t = t0 + tl.arange(0, TOK_TILE)
                    kt = tl.load(k_ptr + ((slot0 + t) * stride_ks + h * stride_kh)[:, None] + d[None, :],
                                 mask=(d < D)[None, :], other=0.0).to(q.dtype)
                    if IEEE:
                        qk = tl.dot(q, tl.trans(kt), input_precision="ieee")
                    else:
                        qk = tl.dot(q, tl.trans(kt))
                    qk = qk * scale
                    m_new = tl.maximum(m_i, tl.max(qk, axis=1))
                    l_i = l_i * tl.exp(m_i - m_new) + tl.sum(tl.exp(qk - m_new[:, None]), axis=1)
                    m_i = m_new
                lse = m_i + tl.log(l_i)
        if ONE_SPLIT and not LSE_ONLY:
            tile = tl.where((c == e)[:, None], lse[None, :], tile)
        else:
            tl.store(lse_row + e * GP + g, lse)
    last = not LSE_ONLY  # LSE_ONLY: the attend ranks the stored log-sum-exps (`ops.fused_step.attend(rank=...)`)
    if not ONE_SPLIT and not LSE_ONLY:
        last = _arrive(cnt_ptr + row_h, SPLITS)
    if last:
        blk = tl.load(first_row + c, mask=c < C, other=-1)
        valid = blk >= 0
        if not ONE_SPLIT:
            tile = tl.load(lse_row + c[:, None] * GP + g[None, :], mask=valid[:, None] & gm[None, :],
                           other=float("-inf"), cache_modifier=".cg")  # [CP, GP]
        n = tl.load(ncand_ptr + r).to(tl.int32)
        arow = r
        if ANCHOR_ROWS:
            arow = tl.load(arows_ptr + r).to(tl.int64)
        idx = blk.to(tl.int32)
        key = candidate_keys(tile, blk, valid, gm, n, sink_blocks, local_blocks,
                             anc_ptr + arow * stride_ab + h * stride_ah, R)
        n_c = tl.sum(valid.to(tl.int32), axis=0)
        o_row = out_ptr + r * stride_ob + h * stride_oh
        pad_slots(o_row, tl.minimum(n_c, K), K, K_TILE)
        chunk_topk(key, valid, idx, n_c, K, o_row, o_row, WRITE_KEYS=False)


def _launch(q, k_buffer, first, block_table, num_candidates, k: int, scale: float, block_size: int,
            sink_blocks: int, local_blocks: int, anchors, anchor_rows, k_scale: float, ws, out, launch, key_codes,
            lse_only: bool):
    bs, h_q, d = q.shape
    h_kv, c = first.shape[1], first.shape[2]
    g = h_q // h_kv
    if ws is None or bs > ws.max_bs or h_kv != ws.num_kv_heads or g != ws.group or c > ws.first_k:
        raise ValueError(f"rerank_blocks on CUDA needs a RerankWorkspace for {bs} rows, {h_kv} kv heads of {g} and "
                         f"{c} first-level blocks")
    if lse_only and bs > ws.ranked_rows:
        raise ValueError(f"candidate_lse for {bs} rows needs a RerankWorkspace(ranked_rows >= {bs}), "
                         f"this one keeps {ws.ranked_rows}")
    if q.stride(-1) != 1 or k_buffer.stride(-1) != 1 or first.stride(-1) != 1:
        raise ValueError("q, k_buffer and first need a contiguous last axis")
    if bs == 0:
        return
    anchors_t, r_count, rows_t = anchor_launch_args(anchors, anchor_rows, h_kv, bs, out)
    splits = ws.splits(bs)
    per = -(-c // splits)
    packed, cscales = key_codes if key_codes is not None else (out, out)  # unread unless PACKED
    if key_codes is not None:
        k_scale = 1.0  # the codes hold K itself
        if not (packed.is_contiguous() and cscales.is_contiguous()):
            raise ValueError("key codes must be contiguous")
    # fp32 keys: a 64-token fp32 tile spills at D = 128 (ptxas, Triton 3.6, sm_90), as in `ops.fused_step.attend`;
    # codes are unpacked to fp32 tiles too
    wide = (k_buffer.element_size() >= 4 or key_codes is not None) and not _interpreting()
    launch = (launch or LaunchOptions()).check()
    _rerank_kernel[(bs, h_kv, splits)](
        q, k_buffer, first, block_table, num_candidates, anchors_t, rows_t, out, ws.lse, ws.counters, packed, cscales,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1), first.stride(0), first.stride(1),
        block_table.stride(0), anchors_t.stride(0), anchors_t.stride(1), out.stride(0), out.stride(1),
        packed.stride(0), packed.stride(1), cscales.stride(0), cscales.stride(1),
        h_kv, g, c, k, splits, per, max(sink_blocks, 0), max(local_blocks, 0), r_count, float(scale) * float(k_scale),
        ANCHOR_ROWS=anchor_rows is not None, D=d, BLOCK_SIZE=block_size,
        TOK_TILE=min(16, block_size) if wide else block_size, GP=ws.gp, BLOCK_D=max(16, _pow2(d)),
        CP=ws.cp, K_TILE=max(16, _pow2(k)), IEEE=q.dtype == torch.float32,
        DOT_F32=q.dtype == torch.bfloat16 and _interpreting(), ONE_SPLIT=splits == 1,
        PACKED=key_codes is not None, BLOCK_HD=max(16, _pow2(d // 2)), LSE_ONLY=lse_only,
        **launch.kwargs(None, 4),
    )


def rerank_blocks_triton(q, k_buffer, first, block_table, num_candidates, k: int, scale: float, block_size: int,
                         sink_blocks: int, local_blocks: int, anchors, anchor_rows, k_scale: float, ws, out=None,
                         launch=None, key_codes=None):
    """`ops.rerank.rerank_blocks` as one launch (same arguments; ws: a `RerankWorkspace`, required)."""
    if out is None:
        bs, h_kv = q.shape[0], first.shape[1]
        out = torch.empty(bs, h_kv, k, dtype=torch.int32, device=q.device)
    _launch(q, k_buffer, first, block_table, num_candidates, k, scale, block_size, sink_blocks, local_blocks, anchors,
            anchor_rows, k_scale, ws, out, launch, key_codes, lse_only=False)
    return out


def candidate_lse_triton(q, k_buffer, first, block_table, scale: float, block_size: int, k_scale: float, ws,
                         launch=None, key_codes=None) -> None:
    """`ops.rerank.candidate_lse`'s launch: each first-level block's per-head log-sum-exp into `ws.lse` (no select)."""
    _launch(q, k_buffer, first, block_table, first, 1, scale, block_size, 0, 0, None, None, k_scale, ws,
            first, launch, key_codes, lse_only=True)


__all__ = ["_rerank_kernel", "candidate_lse_triton", "rerank_blocks_triton"]
