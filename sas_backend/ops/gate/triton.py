"""Gate query (Triton), fused: from the post-RoPE query, undo the model's RoPE, project the G
query heads of each kv group with w_q[h], RMSNorm, gate RoPE.

Same result as `sas_backend.ops.gate.naive.gate_query_post_rope`. One program per (token, kv
head); at decode N is the batch size, so there is one row per program and the projection is a
broadcast-multiply + reduction (a `tl.dot` would need 16 rows). Vectors are handled as their
two RoPE halves (neox layout, see `sas_backend.ops.rope`), so no roll/gather is needed.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from sas_backend.ops.gate.naive import GATE_NORM_EPS

_MAX_CHUNK = 64  # rows of w_q per (half, step): bounds the live w tiles for large head dims


@triton.jit
def _w_rows(w_ptr, r, rmask, col0, stride_wr, stride_wc, HALF_DG, BLOCK_HDG: tl.constexpr):
    """w[r, col0 : col0 + HALF_DG] as fp32 `[len(r), BLOCK_HDG]` (masked lanes 0)."""
    j = tl.arange(0, BLOCK_HDG)
    return tl.load(
        w_ptr + r[:, None] * stride_wr + (col0 + j)[None, :] * stride_wc,
        mask=rmask[:, None] & (j < HALF_DG)[None, :],
        other=0.0,
    ).to(tl.float32)


@triton.jit
def _gate_query_kernel(
    q_ptr, mcs_ptr, wq_ptr, qn_ptr, gcs_ptr, out_ptr,
    stride_qn, stride_qh, stride_mcs, stride_gcs,
    stride_wh, stride_wg, stride_wr, stride_wc, stride_on, stride_oh,
    G, eps,
    HALF_D: tl.constexpr, HALF_DG: tl.constexpr, CHUNK: tl.constexpr, BLOCK_HDG: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    i = tl.arange(0, CHUNK)
    j = tl.arange(0, BLOCK_HDG)
    jm = j < HALF_DG
    p1 = tl.zeros([BLOCK_HDG], tl.float32)  # projection, first / second gate-RoPE half
    p2 = tl.zeros([BLOCK_HDG], tl.float32)
    mcs_row = mcs_ptr + n * stride_mcs
    for g in range(G):
        q_row = q_ptr + n * stride_qn + (h * G + g) * stride_qh
        w_g = wq_ptr + h * stride_wh + g * stride_wg
        for k0 in range(0, HALF_D, CHUNK):
            r = k0 + i
            rm = r < HALF_D
            x1 = tl.load(q_row + r, mask=rm, other=0.0).to(tl.float32)
            x2 = tl.load(q_row + HALF_D + r, mask=rm, other=0.0).to(tl.float32)
            c = tl.load(mcs_row + r, mask=rm, other=1.0)
            s = tl.load(mcs_row + HALF_D + r, mask=rm, other=0.0)
            # Exact inverse of the model's rotation: rotate by -theta and divide by the table's
            # magnitude squared (1 for plain RoPE, mscale^2 for YaRN).
            inv_m2 = 1.0 / (c * c + s * s)
            y1 = (x1 * c + x2 * s) * inv_m2
            y2 = (x2 * c - x1 * s) * inv_m2
            # Rows r (first half of q) and HALF_D + r (second half) of w_q[h, g].
            w11 = _w_rows(w_g, r, rm, 0, stride_wr, stride_wc, HALF_DG, BLOCK_HDG)
            w21 = _w_rows(w_g, HALF_D + r, rm, 0, stride_wr, stride_wc, HALF_DG, BLOCK_HDG)
            p1 += tl.sum(y1[:, None] * w11 + y2[:, None] * w21, axis=0)
            w12 = _w_rows(w_g, r, rm, HALF_DG, stride_wr, stride_wc, HALF_DG, BLOCK_HDG)
            w22 = _w_rows(w_g, HALF_D + r, rm, HALF_DG, stride_wr, stride_wc, HALF_DG, BLOCK_HDG)
            p2 += tl.sum(y1[:, None] * w12 + y2[:, None] * w22, axis=0)

    # RMSNorm over Dg in fp32 (padded lanes are 0).
    var = (tl.sum(p1 * p1, axis=0) + tl.sum(p2 * p2, axis=0)) / (2 * HALF_DG)
    inv = tl.rsqrt(var + eps)
    n1 = p1 * inv * tl.load(qn_ptr + j, mask=jm, other=0.0).to(tl.float32)
    n2 = p2 * inv * tl.load(qn_ptr + HALF_DG + j, mask=jm, other=0.0).to(tl.float32)

    # Gate RoPE at the token's position.
    gcs_row = gcs_ptr + n * stride_gcs
    c = tl.load(gcs_row + j, mask=jm, other=0.0)
    s = tl.load(gcs_row + HALF_DG + j, mask=jm, other=0.0)
    o = out_ptr + n * stride_on + h * stride_oh
    tl.store(o + j, n1 * c - n2 * s, mask=jm)
    tl.store(o + HALF_DG + j, n2 * c + n1 * s, mask=jm)


def gate_query_triton(
    q_post: torch.Tensor,
    model_cos_sin: torch.Tensor,
    w_q: torch.Tensor,
    q_norm: torch.Tensor,
    gate_cos_sin: torch.Tensor,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Gate query per kv head from the post-RoPE query, one launch (as `gate_query_post_rope`).

    q_post: `[N, H_q, D]` fp32/bf16/fp16, last axis contiguous (other strides free, e.g. a view
    into a fused qkv tensor); model_cos_sin: `[N, D]` fp32 model table rows at each token's
    position (a magnitude such as YaRN's mscale is undone exactly); w_q: `[H_kv, G, D, Dg]`
    (H_q = H_kv * G); q_norm: `[Dg]`; gate_cos_sin: `[N, Dg]` fp32.
    out: optional `[N, H_kv, Dg]` fp32 buffer (last axis contiguous) written in place, so a
    CUDA-graph step allocates nothing. No host syncs. Returns `[N, H_kv, Dg]` fp32 (out if given).
    """
    n, h_q, d = q_post.shape
    h_kv, g, d_w, dg = w_q.shape
    if d_w != d or h_kv * g != h_q:
        raise ValueError(f"w_q {tuple(w_q.shape)} does not fit q [.., {h_q}, {d}]: want [H_kv, H_q/H_kv, D, Dg]")
    if d % 2 or dg % 2:
        raise ValueError(f"RoPE needs even dims, got D={d}, Dg={dg}")
    if model_cos_sin.shape != (n, d) or gate_cos_sin.shape != (n, dg) or q_norm.shape != (dg,):
        raise ValueError("model_cos_sin must be [N, D], gate_cos_sin [N, Dg], q_norm [Dg]")
    if model_cos_sin.dtype != torch.float32 or gate_cos_sin.dtype != torch.float32:
        raise ValueError("cos/sin tables must be fp32")
    if out is None:
        out = torch.empty(n, h_kv, dg, dtype=torch.float32, device=q_post.device)
    elif out.shape != (n, h_kv, dg) or out.dtype != torch.float32 or out.stride(-1) != 1:
        raise ValueError(f"out must be an fp32 [{n}, {h_kv}, {dg}] tensor with a contiguous last axis")
    # The kernel indexes the last axis with unit stride; these are no-ops for the usual layouts.
    q_post, model_cos_sin, gate_cos_sin, q_norm = (
        x if x.stride(-1) == 1 else x.contiguous() for x in (q_post, model_cos_sin, gate_cos_sin, q_norm)
    )
    if n == 0 or h_kv == 0:
        return out
    half_d = d // 2
    _gate_query_kernel[(n, h_kv)](
        q_post, model_cos_sin, w_q, q_norm, gate_cos_sin, out,
        q_post.stride(0), q_post.stride(1), model_cos_sin.stride(0), gate_cos_sin.stride(0),
        w_q.stride(0), w_q.stride(1), w_q.stride(2), w_q.stride(3), out.stride(0), out.stride(1),
        g, GATE_NORM_EPS,
        HALF_D=half_d,
        HALF_DG=dg // 2,
        CHUNK=min(_MAX_CHUNK, triton.next_power_of_2(half_d)),
        BLOCK_HDG=triton.next_power_of_2(dg // 2),
    )
    return out
