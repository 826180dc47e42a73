"""Gated sparse-scope attention as fused Triton kernels (FlashAttention-style), forward + backward.

Semantics are those of `naive.gated_attention_naive`: each query attends its own block causally
(no bias) and every previous block whose log-gate reaches its threshold (bias = the log-gate).

Layout of the work:
- A program owns one query tile of one sequence for one kv head: BLOCK_M consecutive tokens times
  the G query heads of that kv head, stacked as G_P2 * BLOCK_M rows (G padded to a power of two).
  Stacking the group shares each K/V tile load and the skip decision (the gates are per kv head),
  and makes one program the sole owner of d(log_g)[h, t, :] for its tokens (no atomics).
- BLOCK_M divides block_size, so all rows of a tile share one own block c. The kv tile is exactly
  one logical block (BLOCK_N == block_size), so its gate bias is one scalar per row.
- Forward: own block first (causal; gives every row a finite running max), then previous blocks
  m < c, skipping any block that no row of the tile selects. Saves LSE `[Hq, T]` fp32.
- Backward: delta = rowsum(dO * O); a query-tile pass recomputes P and dP for dQ and d(log_g)
  (= row sum of dS, summed over the group); a kv-block pass over the query tiles at/after the
  block gives dK and dV (summed over the group by the stacked-row matmuls).

Kernel constraints: block_size a power of two >= 16; log-gates finite or -inf (never +inf);
head dim any size (padded to a power of two). Memory: O(T * Hq * D) besides log_g and its grad.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl


# The Triton interpreter multiplies bf16 bit patterns in tl.dot (triton-lang/triton#11584), so
# under TRITON_INTERPRET=1 the operands are upcast first; bf16 products are exact in fp32, so this
# matches the GPU's bf16 x bf16 -> fp32 dot up to summation order.
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _dot(a, b, PREC: tl.constexpr, UPCAST: tl.constexpr):
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _fwd_kernel(
    Q, K, V, LOG_G, THR, OUT, LSE,
    CU, TILE_SEQ, TILE_START,
    scale, D,
    s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, s_ot, s_oh,
    s_gh, s_gt, s_gm, s_th, s_tt, s_lh,
    GROUP: tl.constexpr, GROUP_P2: tl.constexpr, BLOCK_M: tl.constexpr,
    BS: tl.constexpr, BLOCK_D: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
):
    pid = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)  # int64 offsets: T * Hq * D can pass 2**31
    seq = tl.load(TILE_SEQ + pid)
    q_start = tl.load(TILE_START + pid)
    bos = tl.load(CU + seq).to(tl.int64)
    seqlen = tl.load(CU + seq + 1) - bos

    r = tl.arange(0, GROUP_P2 * BLOCK_M)
    g = r // BLOCK_M
    pos = q_start + r % BLOCK_M
    row_ok = (pos < seqlen) & (g < GROUP)
    tok = bos + pos
    qh = h * GROUP + g
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    offs_n = tl.arange(0, BS)

    q = tl.load(Q + tok[:, None] * s_qt + qh[:, None] * s_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    thr = tl.load(THR + h * s_th + tok * s_tt, mask=row_ok, other=0.0).to(tl.float32)
    c = q_start // BS

    # own block, causal, gate 1
    kpos = c * BS + offs_n
    k_ok = kpos < seqlen
    kv_mask = k_ok[:, None] & d_ok[None, :]
    k = tl.load(K + (bos + kpos)[:, None] * s_kt + h * s_kh + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(V + (bos + kpos)[:, None] * s_vt + h * s_vh + offs_d[None, :], mask=kv_mask, other=0.0)
    s = _dot(q, tl.trans(k), PREC, UPCAST) * scale
    s = tl.where((kpos[None, :] <= pos[:, None]) & k_ok[None, :], s, float("-inf"))
    m_i = tl.max(s, 1)
    p = tl.exp(s - m_i[:, None])
    l_i = tl.sum(p, 1)
    acc = _dot(p.to(V.dtype.element_ty), v, PREC, UPCAST)

    # previous blocks: full, biased by their log-gate, skipped unless some row selects them
    for m in range(0, c):
        lg = tl.load(LOG_G + h * s_gh + tok * s_gt + m * s_gm, mask=row_ok,
                     other=float("-inf")).to(tl.float32)
        sel = (lg >= thr) & row_ok
        if tl.max(sel.to(tl.int32), 0) > 0:
            kpos = m * BS + offs_n
            k = tl.load(K + (bos + kpos)[:, None] * s_kt + h * s_kh + offs_d[None, :],
                        mask=d_ok[None, :], other=0.0)
            v = tl.load(V + (bos + kpos)[:, None] * s_vt + h * s_vh + offs_d[None, :],
                        mask=d_ok[None, :], other=0.0)
            s = _dot(q, tl.trans(k), PREC, UPCAST) * scale + tl.where(sel, lg, 0.0)[:, None]
            s = tl.where(sel[:, None], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + _dot(p.to(V.dtype.element_ty), v, PREC, UPCAST)
            m_i = m_new

    out = acc / l_i[:, None]
    tl.store(OUT + tok[:, None] * s_ot + qh[:, None] * s_oh + offs_d[None, :],
             out.to(OUT.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    tl.store(LSE + qh * s_lh + tok, m_i + tl.log(l_i), mask=row_ok)


@triton.jit
def _delta_kernel(OUT, DO, DELTA, T, D, s_ot, s_oh, s_dt, s_dh, s_lh,
                  BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    # delta[qh, t] = sum_d dO * O: the softmax-backward row term
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    qh = tl.program_id(1).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (t < T)[:, None] & (offs_d < D)[None, :]
    o = tl.load(OUT + t[:, None] * s_ot + qh * s_oh + offs_d[None, :], mask=mask, other=0.0)
    do = tl.load(DO + t[:, None] * s_dt + qh * s_dh + offs_d[None, :], mask=mask, other=0.0)
    tl.store(DELTA + qh * s_lh + t, tl.sum(o.to(tl.float32) * do.to(tl.float32), 1), mask=t < T)


@triton.jit
def _bwd_dq_kernel(
    Q, K, V, LOG_G, THR, DO, LSE, DELTA, DQ, DLOG_G,
    CU, TILE_SEQ, TILE_START,
    scale, D,
    s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, s_dot, s_doh, s_dqt, s_dqh,
    s_gh, s_gt, s_gm, s_th, s_tt, s_lh, s_dgh, s_dgt, s_dgm,
    GROUP: tl.constexpr, GROUP_P2: tl.constexpr, BLOCK_M: tl.constexpr,
    BS: tl.constexpr, BLOCK_D: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
):
    pid = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)  # int64 offsets: T * Hq * D can pass 2**31
    seq = tl.load(TILE_SEQ + pid)
    q_start = tl.load(TILE_START + pid)
    bos = tl.load(CU + seq).to(tl.int64)
    seqlen = tl.load(CU + seq + 1) - bos

    r = tl.arange(0, GROUP_P2 * BLOCK_M)
    g = r // BLOCK_M
    pos = q_start + r % BLOCK_M
    row_ok = (pos < seqlen) & (g < GROUP)
    tok = bos + pos
    qh = h * GROUP + g
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    offs_n = tl.arange(0, BS)
    row_mask = row_ok[:, None] & d_ok[None, :]

    q = tl.load(Q + tok[:, None] * s_qt + qh[:, None] * s_qh + offs_d[None, :], mask=row_mask, other=0.0)
    do = tl.load(DO + tok[:, None] * s_dot + qh[:, None] * s_doh + offs_d[None, :], mask=row_mask, other=0.0)
    lse = tl.load(LSE + qh * s_lh + tok, mask=row_ok, other=0.0)
    delta = tl.load(DELTA + qh * s_lh + tok, mask=row_ok, other=0.0)
    thr = tl.load(THR + h * s_th + tok * s_tt, mask=row_ok, other=0.0).to(tl.float32)
    c = q_start // BS
    # the tile's own tokens, for d(log_g) (one value per token, summed over the group)
    tpos = q_start + tl.arange(0, BLOCK_M)
    t_ok = tpos < seqlen

    # own block, causal
    kpos = c * BS + offs_n
    k_ok = kpos < seqlen
    kv_mask = k_ok[:, None] & d_ok[None, :]
    k = tl.load(K + (bos + kpos)[:, None] * s_kt + h * s_kh + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(V + (bos + kpos)[:, None] * s_vt + h * s_vh + offs_d[None, :], mask=kv_mask, other=0.0)
    s = _dot(q, tl.trans(k), PREC, UPCAST) * scale
    causal = (kpos[None, :] <= pos[:, None]) & k_ok[None, :] & row_ok[:, None]
    p = tl.where(causal, tl.exp(s - lse[:, None]), 0.0)
    dp = _dot(do, tl.trans(v), PREC, UPCAST)
    ds = p * (dp - delta[:, None])
    dq = _dot(ds.to(K.dtype.element_ty), k, PREC, UPCAST)

    for m in range(0, c):
        lg = tl.load(LOG_G + h * s_gh + tok * s_gt + m * s_gm, mask=row_ok,
                     other=float("-inf")).to(tl.float32)
        sel = (lg >= thr) & row_ok
        if tl.max(sel.to(tl.int32), 0) > 0:
            kpos = m * BS + offs_n
            k = tl.load(K + (bos + kpos)[:, None] * s_kt + h * s_kh + offs_d[None, :],
                        mask=d_ok[None, :], other=0.0)
            v = tl.load(V + (bos + kpos)[:, None] * s_vt + h * s_vh + offs_d[None, :],
                        mask=d_ok[None, :], other=0.0)
            s = _dot(q, tl.trans(k), PREC, UPCAST) * scale + tl.where(sel, lg, 0.0)[:, None]
            p = tl.where(sel[:, None], tl.exp(s - lse[:, None]), 0.0)
            dp = _dot(do, tl.trans(v), PREC, UPCAST)
            ds = p * (dp - delta[:, None])
            dq += _dot(ds.to(K.dtype.element_ty), k, PREC, UPCAST)
            # d(log_g)[h, t, m] = sum over the block's keys and the group's heads of dS
            dlg = tl.sum(tl.reshape(tl.sum(ds, 1), (GROUP_P2, BLOCK_M)), 0)
            tl.store(DLOG_G + h * s_dgh + (bos + tpos) * s_dgt + m * s_dgm, dlg, mask=t_ok)

    tl.store(DQ + tok[:, None] * s_dqt + qh[:, None] * s_dqh + offs_d[None, :],
             (dq * scale).to(DQ.dtype.element_ty), mask=row_mask)


@triton.jit
def _bwd_dkdv_kernel(
    Q, K, V, LOG_G, THR, DO, LSE, DELTA, DK, DV,
    CU, BLK_SEQ, BLK_IDX,
    scale, D,
    s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, s_dot, s_doh, s_dkt, s_dkh, s_dvt, s_dvh,
    s_gh, s_gt, s_gm, s_th, s_tt, s_lh,
    GROUP: tl.constexpr, GROUP_P2: tl.constexpr, BLOCK_M: tl.constexpr,
    BS: tl.constexpr, BLOCK_D: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
):
    pid = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)  # int64 offsets: T * Hq * D can pass 2**31
    seq = tl.load(BLK_SEQ + pid)
    n = tl.load(BLK_IDX + pid)
    bos = tl.load(CU + seq).to(tl.int64)
    seqlen = tl.load(CU + seq + 1) - bos

    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    kpos = n * BS + tl.arange(0, BS)
    k_ok = kpos < seqlen
    kv_mask = k_ok[:, None] & d_ok[None, :]
    k = tl.load(K + (bos + kpos)[:, None] * s_kt + h * s_kh + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(V + (bos + kpos)[:, None] * s_vt + h * s_vh + offs_d[None, :], mask=kv_mask, other=0.0)
    dk = tl.zeros([BS, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BS, BLOCK_D], dtype=tl.float32)

    r = tl.arange(0, GROUP_P2 * BLOCK_M)
    g = r // BLOCK_M
    qh = h * GROUP + g
    diag_end = (n + 1) * BS
    # query tiles inside block n see it causally; later tiles see it through their gates
    for q_start in range(n * BS, seqlen, BLOCK_M):
        pos = q_start + r % BLOCK_M
        row_ok = (pos < seqlen) & (g < GROUP)
        tok = bos + pos
        # a tile never straddles blocks, so these are all-true or all-false
        diag = pos < diag_end
        prev = row_ok & (pos >= diag_end)
        lg = tl.load(LOG_G + h * s_gh + tok * s_gt + n * s_gm, mask=prev,
                     other=float("-inf")).to(tl.float32)
        thr = tl.load(THR + h * s_th + tok * s_tt, mask=prev, other=0.0).to(tl.float32)
        sel = (lg >= thr) & prev
        if tl.max((sel | diag).to(tl.int32), 0) > 0:
            row_mask = row_ok[:, None] & d_ok[None, :]
            q = tl.load(Q + tok[:, None] * s_qt + qh[:, None] * s_qh + offs_d[None, :],
                        mask=row_mask, other=0.0)
            do = tl.load(DO + tok[:, None] * s_dot + qh[:, None] * s_doh + offs_d[None, :],
                         mask=row_mask, other=0.0)
            lse = tl.load(LSE + qh * s_lh + tok, mask=row_ok, other=0.0)
            delta = tl.load(DELTA + qh * s_lh + tok, mask=row_ok, other=0.0)
            causal = (kpos[None, :] <= pos[:, None]) & k_ok[None, :] & (row_ok & diag)[:, None]
            mask = causal | sel[:, None]
            s = _dot(q, tl.trans(k), PREC, UPCAST) * scale + tl.where(sel, lg, 0.0)[:, None]
            p = tl.where(mask, tl.exp(s - lse[:, None]), 0.0)
            dv += _dot(tl.trans(p.to(DO.dtype.element_ty)), do, PREC, UPCAST)
            dp = _dot(do, tl.trans(v), PREC, UPCAST)
            ds = p * (dp - delta[:, None])
            dk += _dot(tl.trans(ds.to(Q.dtype.element_ty)), q, PREC, UPCAST)

    tl.store(DK + (bos + kpos)[:, None] * s_dkt + h * s_dkh + offs_d[None, :],
             (dk * scale).to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + (bos + kpos)[:, None] * s_dvt + h * s_dvh + offs_d[None, :],
             dv.to(DV.dtype.element_ty), mask=kv_mask)


def _block_m(block_size: int, group_p2: int) -> int:
    """Query tokens per tile: ~64 stacked rows, >= 16 rows for tl.dot, dividing block_size."""
    return min(block_size, max(16, 64 // group_p2))


def _work_lists(cu_seqlens: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence id, in-sequence start) of every `step`-sized tile of every sequence, int32 `[n]`."""
    bounds = cu_seqlens.tolist()  # one host sync per call: the grid size depends on it
    seq, start = [], []
    for i, (bos, eos) in enumerate(zip(bounds[:-1], bounds[1:])):
        starts = range(0, eos - bos, step)
        seq.extend([i] * len(starts))
        start.extend(starts)
    dev = cu_seqlens.device
    return (torch.tensor(seq, dtype=torch.int32, device=dev),
            torch.tensor(start, dtype=torch.int32, device=dev))


class _Meta:
    """Launch constants shared by forward and backward."""

    def __init__(self, q, k, cu_seqlens, block_size):
        if block_size < 16 or block_size & (block_size - 1):
            raise ValueError(f"kernel needs block_size a power of two >= 16, got {block_size}")
        self.t, self.h_q, self.d = q.shape
        self.h_kv = k.shape[1]
        if self.h_q % self.h_kv:
            raise ValueError(f"Hq={self.h_q} is not a multiple of Hkv={self.h_kv}")
        self.group = self.h_q // self.h_kv
        self.group_p2 = triton.next_power_of_2(self.group)
        self.block_m = _block_m(block_size, self.group_p2)
        self.bs = block_size
        self.block_d = max(16, triton.next_power_of_2(self.d))
        # fp32 inputs get true fp32 matmuls (tests, reference runs); bf16/fp16 use tensor cores
        self.prec = "ieee" if q.dtype == torch.float32 else "tf32"
        self.cu = cu_seqlens.to(torch.int32).contiguous()
        lens = self.cu.diff()
        self.max_blocks = int(triton.cdiv(int(lens.max()), block_size)) if lens.numel() else 0
        self.q_seq, self.q_start = _work_lists(self.cu, self.block_m)
        self.kv_seq, kv_start = _work_lists(self.cu, block_size)
        self.kv_blk = kv_start // block_size

    def consts(self):
        return dict(GROUP=self.group, GROUP_P2=self.group_p2, BLOCK_M=self.block_m, BS=self.bs,
                    BLOCK_D=self.block_d, PREC=self.prec, UPCAST=_INTERPRET,
                    num_warps=8 if self.group_p2 * self.block_m >= 128 else 4, num_stages=1)


def _forward(q, k, v, log_g, threshold, meta, scale):
    o = torch.zeros_like(q)  # zeros: tokens outside every sequence stay defined
    lse = torch.zeros(meta.h_q, meta.t, dtype=torch.float32, device=q.device)
    n_tiles = meta.q_seq.numel()
    if n_tiles:
        _fwd_kernel[(n_tiles, meta.h_kv)](
            q, k, v, log_g, threshold, o, lse,
            meta.cu, meta.q_seq, meta.q_start,
            scale, meta.d,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            o.stride(0), o.stride(1),
            log_g.stride(0), log_g.stride(1), log_g.stride(2),
            threshold.stride(0), threshold.stride(1), lse.stride(0),
            **meta.consts(),
        )
    return o, lse


def _backward(do, q, k, v, o, lse, log_g, threshold, meta, scale):
    dq = torch.zeros_like(q)
    dk = torch.zeros_like(k)
    dv = torch.zeros_like(v)
    dlog_g = torch.zeros(log_g.shape, dtype=torch.float32, device=q.device)
    delta = torch.empty_like(lse)
    if meta.t:
        _delta_kernel[(triton.cdiv(meta.t, 64), meta.h_q)](
            o, do, delta, meta.t, meta.d,
            o.stride(0), o.stride(1), do.stride(0), do.stride(1), delta.stride(0),
            BLOCK_T=64, BLOCK_D=meta.block_d,
        )
    consts = meta.consts()
    n_tiles = meta.q_seq.numel()
    if n_tiles:
        _bwd_dq_kernel[(n_tiles, meta.h_kv)](
            q, k, v, log_g, threshold, do, lse, delta, dq, dlog_g,
            meta.cu, meta.q_seq, meta.q_start,
            scale, meta.d,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            do.stride(0), do.stride(1), dq.stride(0), dq.stride(1),
            log_g.stride(0), log_g.stride(1), log_g.stride(2),
            threshold.stride(0), threshold.stride(1), lse.stride(0),
            dlog_g.stride(0), dlog_g.stride(1), dlog_g.stride(2),
            **consts,
        )
    n_blocks = meta.kv_seq.numel()
    if n_blocks:
        _bwd_dkdv_kernel[(n_blocks, meta.h_kv)](
            q, k, v, log_g, threshold, do, lse, delta, dk, dv,
            meta.cu, meta.kv_seq, meta.kv_blk,
            scale, meta.d,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            do.stride(0), do.stride(1), dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1),
            log_g.stride(0), log_g.stride(1), log_g.stride(2),
            threshold.stride(0), threshold.stride(1), lse.stride(0),
            **consts,
        )
    return dq, dk, dv, dlog_g.to(log_g.dtype)


class GatedAttentionFn(torch.autograd.Function):
    """Autograd wrapper; backward recomputes P from the saved LSE."""

    @staticmethod
    def forward(ctx, q, k, v, log_g, threshold, cu_seqlens, block_size, scale):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        meta = _Meta(q, k, cu_seqlens, block_size)
        if log_g.shape[2] < meta.max_blocks:
            raise ValueError(f"log_g has {log_g.shape[2]} blocks, sequences need {meta.max_blocks}")
        o, lse = _forward(q, k, v, log_g, threshold, meta, scale)
        ctx.save_for_backward(q, k, v, o, lse, log_g, threshold)
        ctx.meta, ctx.scale = meta, scale
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, log_g, threshold = ctx.saved_tensors
        dq, dk, dv, dlog_g = _backward(
            do.contiguous(), q, k, v, o, lse, log_g, threshold, ctx.meta, ctx.scale
        )
        return dq, dk, dv, (dlog_g if ctx.needs_input_grad[3] else None), None, None, None, None


def gated_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_g: torch.Tensor,
    threshold: torch.Tensor,
    cu_seqlens: torch.Tensor,
    block_size: int,
    scale: float | None = None,
) -> torch.Tensor:
    """Fused gated sparse-scope attention over packed variable-length sequences.

    q: `[T, Hq, D]`; k, v: `[T, Hkv, D]` (same dtype as q: bf16, fp16 or fp32);
    log_g: `[Hkv, T, NB]` float, NB = ceil(max_seqlen / block_size), only entries of blocks
    before the query's own block are read; threshold: `[Hkv, T]` float (no gradient);
    cu_seqlens: `[N+1]` int (sequence i = tokens cu_seqlens[i] .. cu_seqlens[i+1]-1).
    block_size: a power of two >= 16. Returns `[T, Hq, D]` in q's dtype; differentiable in
    q, k, v and log_g (d(log_g) in log_g's dtype, zero for unselected or ignored blocks).
    """
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise ValueError("q, k, v must share a dtype")
    if log_g.dim() != 3 or log_g.shape[:2] != (k.shape[1], q.shape[0]):
        raise ValueError(f"log_g must be [Hkv, T, NB], got {tuple(log_g.shape)}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return GatedAttentionFn.apply(q, k, v, log_g, threshold, cu_seqlens, block_size, scale)
