"""The sparse decode step of one layer as three wide Triton kernels: front, select, attend.

The first GPU run (bench/results/gpu-2026-11-27) timed the old step at ~86 us a layer in 8 latency-bound
launches (a serial 64-token summary loop in 8 programs, a gate query in 8 programs, two Top-K passes, a
token-index gather, FlashInfer's prefill-shaped decode and its merge). Here each launch is split so that
batch 1 fills the GPU, and every cross-program reduction is finished by the LAST program to arrive (an
atomic counter per row, reset by that program), so no second launch merges:

- front, grid `(bs, H_kv, UQ + UK)`: programs u < UQ each project one unit (query head, 16 rows per RoPE
  half) of the gate query; the last of a row's UQ sums the partials in unit order, RMSNorm, gate RoPE ->
  `gate_q[r, h]`. Programs u >= UQ each pool and project one slice of head dims of the block the newest
  token completed (all 64 tokens at once, RoPE undone), the last of the UK sums, RMSNorm, gate RoPE at the
  block start -> `summaries[page, h]`; rows that completed no block return at once (63 of 64 steps). With
  SUB sub-block summaries (`StepGeometry.sub_blocks`) the same is done per run of b / SUB tokens (gate RoPE
  at the run's start), the runs' summaries side by side in the row. With CODES (`--sas-rerank-keys int4`) each
  unit also writes its channels' 4-bit key codes of the block (`ops.key_codes`: a unit owns channels i and
  i + D/2, the two nibbles of a byte).
- select, grid `(bs, H_kv, NC)`, NC from the plan's width, not the context: program c scores blocks
  `[c*CHUNK, (c+1)*CHUNK)` against the row's summaries (the best of a block's SUB run summaries; forced
  sink / local blocks and prompt anchors by
  their keys, `ops.topk.triton.score_keys`) and keeps their local top K (the radix threshold select of
  `ops.topk.triton`); the last active chunk of a row merges the survivors -> the row's K block ids.
  A row whose candidates fit one chunk is selected by that chunk alone.
- attend, grid `(bs, H_kv, SPLITS)`: split s attends blocks `[s*BPS, (s+1)*BPS)` of the row's K selected
  blocks followed by its current block, read through the block table (token o of block m at slot
  `block_table[r, m] + o`), the G query heads of the kv group as one `tl.dot` tile (padded to 16 rows),
  online softmax; the last split to arrive merges the splits' (max, sum, acc) -> out. With one split (a batch
  that fills the device alone) the program writes out directly: no partials, fence, atomic or merge.

With PDL (programmatic dependent launch, sm_90+; `LaunchOptions.pdl`) each kernel is launched before its
predecessor ends: it first waits for it (`gdc_wait` returns once the predecessor grid has completed and its
writes are visible), then lets its own successor launch (`gdc_launch_dependents`), so a launch's start-up
overlaps the previous launch's tail. Without PDL both are compiled out.

Unit, chunk and split counts depend on the geometry and the plan, never on a row's length, so a CUDA-graph
replay runs the same grid whatever the context. The counters must be zero before the first launch
(`DecodeStepWorkspace` allocates them zeroed); each launch leaves them zero.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from sas_backend.ops.gate import GATE_NORM_EPS
from sas_backend.ops.gate.triton import norm_rope_store, project_rows
from sas_backend.ops.key_codes.triton import quantize_columns
from sas_backend.ops.topk.triton import INT32_MIN, pad_slots, chunk_topk, merge_topk, score_keys

_ = GATE_NORM_EPS  # re-exported for the launchers


@triton.jit
def _after_predecessor(PDL: tl.constexpr):
    """PDL: wait for the previous launch to complete, then let the next one start launching."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def _arrive(cnt_ptr, expected):
    """1 in the last of `expected` programs to arrive at this counter (which it resets), else 0.

    The barrier makes every thread's partial stores precede the atomic; acq_rel orders them before the
    last program's reads (which go through L2, `.cg`)."""
    tl.debug_barrier()
    old = tl.atomic_add(cnt_ptr, 1, sem="acq_rel")
    last = old == expected - 1
    if last:
        tl.atomic_xchg(cnt_ptr, 0, sem="relaxed")
    return last


@triton.jit
def candidate_keys(tile, blk, valid, gm, n, sink_blocks, local_blocks, anc_base, R):
    """The second level's rule (`ops.rerank`) as order-preserving int32 keys `[CP]` of a row's first-level
    candidates: tile `[CP, GP]` each candidate's per-query-head log-sum-exp; blk `[CP]` its block (valid where >= 0);
    gm `[GP]` the group's real heads; n the row's candidates; anchors at `anc_base + a`, a < R (+inf). Each head's
    log-sums normalized over the row's candidates (log attention mass among them), the max over the group, sink /
    local blocks and anchors forced (`ops.topk.triton.score_keys`). Shared by the rerank's own select and the attend
    that ranks (`rank_candidates`), so both keep the same blocks."""
    tile = tl.where(valid[:, None] & gm[None, :], tile, float("-inf"))
    top = tl.max(tile, axis=0)
    top = tl.where(top > float("-inf"), top, 0.0)  # a row without blocks: every entry stays -inf
    mass_sum = tl.sum(tl.exp(tile - top[None, :]), axis=0)
    total = top + tl.log(tl.where(mass_sum > 0, mass_sum, 1.0))  # padded heads: finite, masked below
    mass = tl.where(valid[:, None] & gm[None, :], tile - total[None, :], float("-inf"))
    x = tl.max(mass, axis=1)  # [CP]: the block's log-mass, max over the group
    for a in range(R):
        anchor = tl.load(anc_base + a)
        x = tl.where(valid & (blk == anchor), float("inf"), x)
    return score_keys(x, blk.to(tl.int32), n, sink_blocks, local_blocks)


@triton.jit
def rank_candidates(key, blk, valid, K, CP: tl.constexpr, RT: tl.constexpr):
    """(kept `[CP]`, pos `[CP]`): the K valid candidates of highest key, ties to the lower block (the rule of
    `ops.topk.select_blocks`), found by counting in registers: a candidate's rank is how many valid ones beat it,
    compared RT at a time (`[RT, CP]` tiles bound the registers); pos its place among the kept ones (blk ascending,
    so the kept blocks' ascending order)."""
    c = tl.arange(0, CP)
    rank = tl.zeros([CP], tl.int32)
    for c0 in tl.static_range(0, CP, RT):
        pick = c[None, :] == (c0 + tl.arange(0, RT))[:, None]  # [RT, CP]: row i is candidate c0 + i
        k_i = tl.sum(tl.where(pick, key[None, :], 0), axis=1)  # one term each: exact
        b_i = tl.sum(tl.where(pick, blk[None, :], 0), axis=1)
        v_i = tl.sum(tl.where(pick, valid[None, :].to(tl.int32), 0), axis=1) > 0
        beats = v_i[:, None] & ((k_i[:, None] > key[None, :]) | ((k_i[:, None] == key[None, :])
                                                                & (b_i[:, None] < blk[None, :])))
        rank += tl.sum(beats.to(tl.int32), axis=0)
    kept = valid & (rank < K)
    pos = tl.cumsum(kept.to(tl.int32), axis=0) - 1
    return kept, pos


@triton.jit
def _front_kernel(
    # gate query
    q_ptr, mcs_ptr, gcs_ptr, wq_ptr, qn_ptr, gq_ptr,
    # summary of the block the newest token completed
    k_ptr, mtab_ptr, gtab_ptr, wk_ptr, kn_ptr, summ_ptr, bt_ptr, seq_ptr,
    wsq_ptr, wsk_ptr, cnt_ptr, codes_ptr, cs_ptr,
    stride_qn, stride_qh, stride_mcs, stride_gcs,
    stride_wqh, stride_wqg, stride_wqr, stride_wqc,
    stride_gqn, stride_gqh,
    stride_ks, stride_kh, stride_mtab, stride_gtab,
    stride_wkh, stride_wkr, stride_wkc,
    stride_sp, stride_sh, stride_bt, stride_cp, stride_ch, stride_csp, stride_csh,
    H_KV, G, UQ, UQ_PER_HEAD, UK, eps, k_scale,
    HALF_D: tl.constexpr, HALF_DG: tl.constexpr, QCHUNK: tl.constexpr, KCHUNK: tl.constexpr,
    BLOCK_HDG: tl.constexpr, BLOCK_SIZE: tl.constexpr, PDL: tl.constexpr, SUB: tl.constexpr = 1,
    CODES: tl.constexpr = False,
):
    _after_predecessor(PDL)
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    u = tl.program_id(2)
    j = tl.arange(0, BLOCK_HDG)
    jm = j < HALF_DG
    row_h = n * H_KV + h
    if u < UQ:
        # --- gate query, unit u = (query head g, rows [k0, k0 + QCHUNK) of each RoPE half) ---
        g = u // UQ_PER_HEAD
        r = (u % UQ_PER_HEAD) * QCHUNK + tl.arange(0, QCHUNK)
        q_row = q_ptr + n * stride_qn + (h * G + g) * stride_qh
        w_g = wq_ptr + h * stride_wqh + g * stride_wqg
        d1, d2 = project_rows(q_row, mcs_ptr + n * stride_mcs, w_g, r, r < HALF_D, stride_wqr, stride_wqc,
                               HALF_D, HALF_DG, BLOCK_HDG)
        ws = wsq_ptr + (row_h * UQ + u) * (2 * HALF_DG)
        tl.store(ws + j, d1, mask=jm)
        tl.store(ws + HALF_DG + j, d2, mask=jm)
        if _arrive(cnt_ptr + 2 * row_h, UQ):
            base = wsq_ptr + row_h * UQ * (2 * HALF_DG)
            p1 = tl.zeros([BLOCK_HDG], tl.float32)
            p2 = tl.zeros([BLOCK_HDG], tl.float32)
            for v in range(UQ):  # unit order: deterministic, as the split gate-query launch sums
                p1 += tl.load(base + v * (2 * HALF_DG) + j, mask=jm, other=0.0, cache_modifier=".cg")
                p2 += tl.load(base + v * (2 * HALF_DG) + HALF_DG + j, mask=jm, other=0.0, cache_modifier=".cg")
            norm_rope_store(p1, p2, qn_ptr, gcs_ptr + n * stride_gcs, gq_ptr + n * stride_gqn + h * stride_gqh,
                             eps, HALF_DG, BLOCK_HDG)
    else:
        # --- summary of the completed block, unit uk = head dims [uk*KCHUNK, (uk+1)*KCHUNK) of each half; with
        # SUB run summaries a block, each run of b / SUB tokens is pooled, projected and stored on its own ---
        seq_len = tl.load(seq_ptr + n).to(tl.int64)
        if (seq_len > 0) & (seq_len % BLOCK_SIZE == 0):
            uk = u - UQ
            block = seq_len // BLOCK_SIZE - 1
            slot0 = tl.load(bt_ptr + n * stride_bt + block).to(tl.int64)
            i = uk * KCHUNK + tl.arange(0, KCHUNK)
            im = (i < HALF_D)[None, :]
            w_h = wk_ptr + h * stride_wkh
            ik = i < HALF_D
            if CODES:  # --sas-rerank-keys int4: the unit's channels i and i + D/2 of the block, at 4 bits
                tb = tl.arange(0, BLOCK_SIZE)
                kb = k_ptr + ((slot0 + tb) * stride_ks + h * stride_kh)[:, None] + i[None, :]
                c1, lo1, st1 = quantize_columns(tl.load(kb, mask=im, other=0.0).to(tl.float32) * k_scale)
                c2, lo2, st2 = quantize_columns(tl.load(kb + HALF_D, mask=im, other=0.0).to(tl.float32) * k_scale)
                page_c = slot0 // BLOCK_SIZE
                tl.store(codes_ptr + page_c * stride_cp + h * stride_ch + tb[:, None] * HALF_D + i[None, :],
                         (c1 | (c2 << 4)).to(tl.uint8), mask=im)
                cs = cs_ptr + page_c * stride_csp + h * stride_csh + i  # [2, D]: lo, then step
                tl.store(cs, lo1, mask=ik)
                tl.store(cs + HALF_D, lo2, mask=ik)
                tl.store(cs + 2 * HALF_D, st1, mask=ik)
                tl.store(cs + 3 * HALF_D, st2, mask=ik)
            ws = wsk_ptr + (row_h * UK + uk) * SUB * (2 * HALF_DG)
            for run in tl.static_range(SUB):
                t = run * (BLOCK_SIZE // SUB) + tl.arange(0, BLOCK_SIZE // SUB)
                kp = k_ptr + ((slot0 + t) * stride_ks + h * stride_kh)[:, None] + i[None, :]
                # [b / SUB, KCHUNK]: the run's tokens at once, dequantized (an fp8 cache holds K / k_scale)
                x1 = tl.load(kp, mask=im, other=0.0).to(tl.float32) * k_scale
                x2 = tl.load(kp + HALF_D, mask=im, other=0.0).to(tl.float32) * k_scale
                cp = mtab_ptr + ((block * BLOCK_SIZE + t) * stride_mtab)[:, None] + i[None, :]
                c = tl.load(cp, mask=im, other=1.0)
                s = tl.load(cp + HALF_D, mask=im, other=0.0)
                inv_m2 = 1.0 / (c * c + s * s)  # exact inverse, a magnitude (YaRN) included
                y1 = (x1 * c + x2 * s) * inv_m2
                y2 = (x2 * c - x1 * s) * inv_m2
                # cat(max, min, mean) [3D] rows of w_k: statistic st, half hh -> row st*2*HALF_D + hh*HALF_D + i.
                mean1 = tl.sum(y1, axis=0) / (BLOCK_SIZE // SUB)
                mean2 = tl.sum(y2, axis=0) / (BLOCK_SIZE // SUB)
                p1 = tl.zeros([BLOCK_HDG], tl.float32)
                p2 = tl.zeros([BLOCK_HDG], tl.float32)
                p1, p2 = _seg_dot(tl.max(y1, axis=0), p1, p2, w_h, 0 * HALF_D + i, ik, stride_wkr, stride_wkc,
                                  HALF_DG, BLOCK_HDG)
                p1, p2 = _seg_dot(tl.max(y2, axis=0), p1, p2, w_h, 1 * HALF_D + i, ik, stride_wkr, stride_wkc,
                                  HALF_DG, BLOCK_HDG)
                p1, p2 = _seg_dot(tl.min(y1, axis=0), p1, p2, w_h, 2 * HALF_D + i, ik, stride_wkr, stride_wkc,
                                  HALF_DG, BLOCK_HDG)
                p1, p2 = _seg_dot(tl.min(y2, axis=0), p1, p2, w_h, 3 * HALF_D + i, ik, stride_wkr, stride_wkc,
                                  HALF_DG, BLOCK_HDG)
                p1, p2 = _seg_dot(mean1, p1, p2, w_h, 4 * HALF_D + i, ik, stride_wkr, stride_wkc, HALF_DG, BLOCK_HDG)
                p1, p2 = _seg_dot(mean2, p1, p2, w_h, 5 * HALF_D + i, ik, stride_wkr, stride_wkc, HALF_DG, BLOCK_HDG)
                tl.store(ws + run * (2 * HALF_DG) + j, p1, mask=jm)
                tl.store(ws + run * (2 * HALF_DG) + HALF_DG + j, p2, mask=jm)
            if _arrive(cnt_ptr + 2 * row_h + 1, UK):
                base = wsk_ptr + row_h * UK * SUB * (2 * HALF_DG)
                page = slot0 // BLOCK_SIZE
                for run in tl.static_range(SUB):
                    a1 = tl.zeros([BLOCK_HDG], tl.float32)
                    a2 = tl.zeros([BLOCK_HDG], tl.float32)
                    for v in range(UK):
                        part = base + (v * SUB + run) * (2 * HALF_DG)
                        a1 += tl.load(part + j, mask=jm, other=0.0, cache_modifier=".cg")
                        a2 += tl.load(part + HALF_DG + j, mask=jm, other=0.0, cache_modifier=".cg")
                    var = (tl.sum(a1 * a1, axis=0) + tl.sum(a2 * a2, axis=0)) / (2 * HALF_DG)
                    inv = tl.rsqrt(var + eps)
                    n1 = a1 * inv * tl.load(kn_ptr + j, mask=jm, other=0.0).to(tl.float32)
                    n2 = a2 * inv * tl.load(kn_ptr + HALF_DG + j, mask=jm, other=0.0).to(tl.float32)
                    # gate RoPE at the run's first position
                    gp = gtab_ptr + (block * BLOCK_SIZE + run * (BLOCK_SIZE // SUB)) * stride_gtab
                    gc = tl.load(gp + j, mask=jm, other=0.0)
                    gs = tl.load(gp + HALF_DG + j, mask=jm, other=0.0)
                    o = summ_ptr + page * stride_sp + h * stride_sh + run * (2 * HALF_DG)
                    tl.store(o + j, (n1 * gc - n2 * gs).to(summ_ptr.dtype.element_ty), mask=jm)
                    tl.store(o + HALF_DG + j, (n2 * gc + n1 * gs).to(summ_ptr.dtype.element_ty), mask=jm)


@triton.jit
def _seg_dot(a, p1, p2, w_h, rows, rmask, stride_wr, stride_wc, HALF_DG, BLOCK_HDG: tl.constexpr):
    """(p1, p2) + a `[KCHUNK]` @ w_k[h][rows, :], the two gate-RoPE halves of the Dg columns, fp32."""
    j = tl.arange(0, BLOCK_HDG)
    m = rmask[:, None] & (j < HALF_DG)[None, :]
    base = w_h + rows[:, None] * stride_wr
    w1 = tl.load(base + j[None, :] * stride_wc, mask=m, other=0.0).to(tl.float32)
    w2 = tl.load(base + (HALF_DG + j)[None, :] * stride_wc, mask=m, other=0.0).to(tl.float32)
    return p1 + tl.sum(a[:, None] * w1, axis=0), p2 + tl.sum(a[:, None] * w2, axis=0)


@triton.jit
def _select_kernel(
    gq_ptr, summ_ptr, bt_ptr, ncand_ptr, anc_ptr, arow_ptr, out_ptr, ws_ptr, cnt_ptr,
    stride_gqn, stride_gqh, stride_sp, stride_sh, stride_bt, stride_ab, stride_ah, stride_ob, stride_oh,
    H_KV, M, K, SLOTS, NC, ROWS_GIVEN: tl.constexpr, sink_blocks, local_blocks, R, inv_sqrt_dg,
    DG: tl.constexpr, BLOCK_DG: tl.constexpr, DG_TILE: tl.constexpr, BLOCK_SIZE: tl.constexpr, CHUNK: tl.constexpr,
    SLOT_TILE: tl.constexpr, MERGE_TILE: tl.constexpr, K_TILE: tl.constexpr, PDL: tl.constexpr,
    SUB: tl.constexpr = 1,
):
    _after_predecessor(PDL)
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    c = tl.program_id(2)
    n = tl.maximum(tl.minimum(tl.load(ncand_ptr + r).to(tl.int32), M), 0)
    active = tl.maximum((n + CHUNK - 1) // CHUNK, 1)
    if c < active:
        idx = c * CHUNK + tl.arange(0, CHUNK)
        valid = idx < n
        pages = tl.load(bt_ptr + r * stride_bt + idx, mask=valid, other=0).to(tl.int64) // BLOCK_SIZE
        # Dg in tiles of DG_TILE columns: a [CHUNK, DG_TILE] summary tile at a time stays in registers.
        # SUB run summaries a block, DG columns each side by side: the block scores its best run.
        x = tl.full([CHUNK], float("-inf"), tl.float32)
        s_row = summ_ptr + (pages * stride_sp + h * stride_sh)[:, None]
        for run in tl.static_range(SUB):
            x_run = tl.zeros([CHUNK], tl.float32)
            for j0 in tl.static_range(0, BLOCK_DG, DG_TILE):
                j = j0 + tl.arange(0, DG_TILE)
                kg = tl.load(s_row + run * DG + j[None, :], mask=valid[:, None] & (j < DG)[None, :],
                             other=0.0).to(tl.float32)
                gq = tl.load(gq_ptr + r * stride_gqn + h * stride_gqh + j, mask=j < DG, other=0.0)
                x_run += tl.sum(kg * gq[None, :], axis=1)
            x = tl.maximum(x, x_run)
        x = x * inv_sqrt_dg
        # Prompt anchors rank as +inf (`ops.anchors.force_anchors`), under the forced sink / local keys.
        if R > 0:
            arow = r
            if ROWS_GIVEN:
                arow = tl.load(arow_ptr + r).to(tl.int64)
            for a in range(R):
                anchor = tl.load(anc_ptr + arow * stride_ab + h * stride_ah + a)
                x = tl.where(idx == anchor, float("inf"), x)
        key = score_keys(x, idx, n, sink_blocks, local_blocks)
        n_c = tl.minimum(tl.maximum(n - c * CHUNK, 0), CHUNK)
        o_row = out_ptr + r * stride_ob + h * stride_oh
        if active == 1:  # the row fits one chunk: its top K is the answer
            pad_slots(o_row, tl.minimum(n_c, K), K, K_TILE)
            chunk_topk(key, valid, idx, n_c, K, o_row, o_row, WRITE_KEYS=False)
        else:
            row_h = r * H_KV + h
            key_row = ws_ptr + row_h * (2 * NC * SLOTS)
            idx_row = key_row + NC * SLOTS
            pad_slots(idx_row + c * SLOTS, tl.minimum(n_c, K), SLOTS, SLOT_TILE)
            chunk_topk(key, valid, idx, n_c, K, idx_row + c * SLOTS, key_row + c * SLOTS, WRITE_KEYS=True)
            if _arrive(cnt_ptr + row_h, active):
                merge_topk(key_row, idx_row, o_row, n, K, active * SLOTS, MERGE_TILE, K_TILE, True)


@triton.jit
def _attend_kernel(
    q_ptr, k_ptr, v_ptr, sel_ptr, bt_ptr, seq_ptr, out_ptr, wsm_ptr, wsa_ptr, cnt_ptr,
    lse_ptr, first_ptr, ncand_ptr, anc_ptr, arows_ptr,
    stride_qn, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_selb, stride_selh, stride_bt,
    stride_on, stride_oh, stride_fb, stride_fh, stride_ab, stride_ah,
    H_KV, G, K, SPLITS, BPS, scale, v_scale, C, sink_blocks, local_blocks, R,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_SIZE: tl.constexpr, TOK: tl.constexpr, TOK_TILE: tl.constexpr,
    GP: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, SPLITS_P: tl.constexpr, IEEE: tl.constexpr,
    DOT_F32: tl.constexpr, PDL: tl.constexpr, ONE_SPLIT: tl.constexpr = False, RANKED: tl.constexpr = False,
    CP: tl.constexpr = 16, RT: tl.constexpr = 16, K_TILE: tl.constexpr = 16, ANCHOR_ROWS: tl.constexpr = False,
):
    _after_predecessor(PDL)
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.program_id(2)
    seq_len = tl.load(seq_ptr + r).to(tl.int64)
    cur = tl.maximum(seq_len - 1, 0) // BLOCK_SIZE
    g = tl.arange(0, GP)
    gm = g < G
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q = tl.load(q_ptr + r * stride_qn + (h * G + g)[:, None] * stride_qh + d[None, :],
                mask=gm[:, None] & (d < D)[None, :], other=0.0)
    if DOT_F32:  # Triton's interpreter computes bf16 tl.dot wrongly (seen with 3.6 and 3.9): fp32 on CPU
        q = q.to(tl.float32)
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, BLOCK_DV], tl.float32)
    lo = s * BPS
    hi = tl.minimum(lo + BPS, K + 1)
    sel_row = sel_ptr + r * stride_selb + h * stride_selh
    if RANKED:
        # Two levels with the top-K here (`ops.rerank.candidate_lse`): every split ranks its row's first-level
        # candidates from their log-sum-exps (the same keys as the rerank's own select), keeps K by counting and
        # attends its share of the kept blocks in ascending order; split 0 also writes the selection (debug, tests).
        c = tl.arange(0, CP)
        first_row = first_ptr + r * stride_fb + h * stride_fh
        cand = tl.load(first_row + c, mask=c < C, other=-1)
        valid = cand >= 0
        tile = tl.load(lse_ptr + (r * H_KV + h) * (CP * GP) + c[:, None] * GP + g[None, :],
                       mask=valid[:, None] & gm[None, :], other=float("-inf"))
        arow = r
        if ANCHOR_ROWS:
            arow = tl.load(arows_ptr + r).to(tl.int64)
        n = tl.load(ncand_ptr + r).to(tl.int32)
        key = candidate_keys(tile, cand, valid, gm, n, sink_blocks, local_blocks,
                             anc_ptr + arow * stride_ab + h * stride_ah, R)
        kept, pos = rank_candidates(key, cand, valid, K, CP, RT)
        if s == 0:
            tl.store(sel_row + pos, cand, mask=kept)
            kk = tl.arange(0, K_TILE)
            tl.store(sel_row + kk, tl.full([K_TILE], -1, tl.int32),
                     mask=(kk >= tl.sum(kept.to(tl.int32), axis=0)) & (kk < K))
        # one [CP] vector lives through the loop: each kept block's place above bit 20 and its index below (blocks
        # < 2**20 a row, 64M tokens), -1 for the rest (fewer live registers: ptxas spilled with three)
        placed = tl.where(kept, (pos << 20) | cand, -1)
    for e in range(lo, hi):
        # Entries 0..K-1: the selection (ascending, -1 padded); entry K: the current block, always attended.
        if RANKED:
            blk = tl.max(tl.where((placed >> 20) == e, placed & 0xFFFFF, -1), axis=0).to(tl.int64)
        else:
            blk = tl.load(sel_row + e, mask=e < K, other=-1).to(tl.int64)
        blk = tl.where(e == K, cur, blk)
        if blk >= 0:
            slot0 = tl.load(bt_ptr + r * stride_bt + blk).to(tl.int64)
            # The block in token tiles (TOK_TILE < TOK only for fp32 K/V, whose FMA dots need the registers).
            for t0 in range(0, TOK, TOK_TILE):  # a runtime loop: unrolled, its hoisted loads spill
                t = t0 + tl.arange(0, TOK_TILE)
                tm = (t < BLOCK_SIZE) & (blk * BLOCK_SIZE + t < seq_len)  # the current block: causal limit
                kt = tl.load(k_ptr + ((slot0 + t) * stride_ks + h * stride_kh)[:, None] + d[None, :],
                             mask=tm[:, None] & (d < D)[None, :], other=0.0).to(q.dtype)
                if IEEE:
                    qk = tl.dot(q, tl.trans(kt), input_precision="ieee")
                else:
                    qk = tl.dot(q, tl.trans(kt))
                qk = tl.where(tm[None, :], qk * scale, float("-inf"))
                # A tile past the newest token is all -inf; the block's first tile never is, so m_i is finite.
                m_new = tl.maximum(m_i, tl.max(qk, axis=1))
                alpha = tl.exp(m_i - m_new)
                p = tl.exp(qk - m_new[:, None])
                l_i = l_i * alpha + tl.sum(p, axis=1)
                vt = tl.load(v_ptr + ((slot0 + t) * stride_vs + h * stride_vh)[:, None] + dv[None, :],
                             mask=tm[:, None] & (dv < DV)[None, :], other=0.0).to(q.dtype)
                if IEEE:
                    acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision="ieee")
                else:
                    acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
                m_i = m_new
    if ONE_SPLIT:  # the whole row in this program: no partials, no fence or atomic, no merge (bit-identical to it)
        o_row = acc / l_i[:, None] * v_scale
        tl.store(out_ptr + r * stride_on + (h * G + g)[:, None] * stride_oh + dv[None, :],
                 o_row.to(out_ptr.dtype.element_ty), mask=gm[:, None] & (dv < DV)[None, :])
    else:
        # Partials [row_h, split, G] of (max, sum) and [row_h, split, G, DV] of acc; only the G real heads.
        row_h = r * H_KV + h
        wm = wsm_ptr + (row_h * SPLITS + s) * (2 * GP)
        tl.store(wm + g, m_i, mask=gm)
        tl.store(wm + GP + g, l_i, mask=gm)
        wa = wsa_ptr + ((row_h * SPLITS + s) * GP) * BLOCK_DV
        tl.store(wa + g[:, None] * BLOCK_DV + dv[None, :], acc, mask=gm[:, None])
        if _arrive(cnt_ptr + row_h, SPLITS):
            sp = tl.arange(0, SPLITS_P)
            spm = sp < SPLITS
            base_m = wsm_ptr + (row_h * SPLITS + sp) * (2 * GP)
            base_a = wsa_ptr + ((row_h * SPLITS + sp) * GP) * BLOCK_DV
            for gg in range(G):
                ms = tl.load(base_m + gg, mask=spm, other=float("-inf"), cache_modifier=".cg")
                ls = tl.load(base_m + GP + gg, mask=spm, other=0.0, cache_modifier=".cg")
                top = tl.max(ms, axis=0)
                w = tl.where(ms > float("-inf"), tl.exp(ms - top), 0.0)
                a = tl.load(base_a[:, None] + gg * BLOCK_DV + dv[None, :], mask=spm[:, None], other=0.0,
                            cache_modifier=".cg")
                o = tl.sum(w[:, None] * a, axis=0) / tl.sum(w * ls, axis=0) * v_scale
                tl.store(out_ptr + r * stride_on + (h * G + gg) * stride_oh + dv, o.to(out_ptr.dtype.element_ty),
                         mask=dv < DV)


__all__ = ["INT32_MIN", "_attend_kernel", "_front_kernel", "_select_kernel", "candidate_keys", "rank_candidates"]
