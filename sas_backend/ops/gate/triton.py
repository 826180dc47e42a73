"""Gate query (Triton), fused: from the post-RoPE query, undo the model's RoPE, project the G
query heads of each kv group with w_q[h], RMSNorm, gate RoPE.

Same result as `sas_backend.ops.gate.naive.gate_query_post_rope`. Vectors are handled as their two
RoPE halves (neox layout, see `sas_backend.ops.rope`), so no roll/gather is needed. At decode N is
the batch size, one row per (token, kv head), so the projection is a broadcast-multiply + reduction
(a `tl.dot` would need 16 rows). Two ways to spread it:

- split (the default on CUDA): the projection's rows (G query heads x D/2 per RoPE half) are cut into
  U units of `_SPLIT_CHUNK` rows; grid `(N, H_kv, U)` writes each unit's partial projection to a scratch
  `[N, H_kv, U, Dg]`, and a second launch, grid `(N, H_kv)`, sums the U partials in a fixed order, then
  RMSNorm and gate RoPE. The first GPU run (H200, Qwen3-4B shape) measured the unsplit kernel at 10.7 us
  a layer at batch 1 and at batch 8 alike: 8 programs, each reading its kv head's 256 KB of fp32 w_q in
  4 serial steps. Split, batch 1 has 128 programs of 16 KB each. U depends on the geometry only, never
  on N, so a padded CUDA-graph batch computes bit for bit what the eager batch does.
- unsplit (`split=False`): one program per (token, kv head), one launch, the first GPU run's kernel; kept
  so the decode-step benchmark times it beside the split one until a GPU run has compared them.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from sas_backend.ops.gate.torch_path import GATE_NORM_EPS

_MAX_CHUNK = 64  # rows of w_q per (half, step): bounds the live w tiles for large head dims
_SPLIT_CHUNK = 16  # rows of w_q per unit of the split launch: 4 KB fp32 tiles at Dg = 128


@triton.jit
def _w_rows(w_ptr, r, rmask, col0, stride_wr, stride_wc, HALF_DG, BLOCK_HDG: tl.constexpr):
    """w[r, col0 : col0 + HALF_DG] as fp32 `[len(r), BLOCK_HDG]` (masked lanes 0)."""
    j = tl.arange(0, BLOCK_HDG)
    return tl.load(
        w_ptr + r[:, None] * stride_wr + (col0 + j)[None, :] * stride_wc,
        mask=rmask[:, None] & (j < HALF_DG)[None, :],
        other=0.0,
    ).to(tl.float32)


# project_rows and norm_rope_store are this op's Triton building blocks, shared with the fused decode step's front.
@triton.jit
def project_rows(q_row, mcs_row, w_g, r, rm, stride_wr, stride_wc, HALF_D, HALF_DG, BLOCK_HDG: tl.constexpr):
    """Rows r (and HALF_D + r) of query head g's contribution to the projection: `([BLOCK_HDG], [BLOCK_HDG])`,
    the first / second gate-RoPE half, fp32."""
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
    d1 = tl.sum(y1[:, None] * w11 + y2[:, None] * w21, axis=0)
    w12 = _w_rows(w_g, r, rm, HALF_DG, stride_wr, stride_wc, HALF_DG, BLOCK_HDG)
    w22 = _w_rows(w_g, HALF_D + r, rm, HALF_DG, stride_wr, stride_wc, HALF_DG, BLOCK_HDG)
    d2 = tl.sum(y1[:, None] * w12 + y2[:, None] * w22, axis=0)
    return d1, d2


@triton.jit
def norm_rope_store(p1, p2, qn_ptr, gcs_row, o, eps, HALF_DG, BLOCK_HDG: tl.constexpr):
    """RMSNorm over Dg in fp32 (padded lanes are 0), gate RoPE at the token's position, store to o."""
    j = tl.arange(0, BLOCK_HDG)
    jm = j < HALF_DG
    var = (tl.sum(p1 * p1, axis=0) + tl.sum(p2 * p2, axis=0)) / (2 * HALF_DG)
    inv = tl.rsqrt(var + eps)
    n1 = p1 * inv * tl.load(qn_ptr + j, mask=jm, other=0.0).to(tl.float32)
    n2 = p2 * inv * tl.load(qn_ptr + HALF_DG + j, mask=jm, other=0.0).to(tl.float32)
    c = tl.load(gcs_row + j, mask=jm, other=0.0)
    s = tl.load(gcs_row + HALF_DG + j, mask=jm, other=0.0)
    tl.store(o + j, n1 * c - n2 * s, mask=jm)
    tl.store(o + HALF_DG + j, n2 * c + n1 * s, mask=jm)


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
    p1 = tl.zeros([BLOCK_HDG], tl.float32)  # projection, first / second gate-RoPE half
    p2 = tl.zeros([BLOCK_HDG], tl.float32)
    mcs_row = mcs_ptr + n * stride_mcs
    for g in range(G):
        q_row = q_ptr + n * stride_qn + (h * G + g) * stride_qh
        w_g = wq_ptr + h * stride_wh + g * stride_wg
        for k0 in range(0, HALF_D, CHUNK):
            r = k0 + i
            d1, d2 = project_rows(q_row, mcs_row, w_g, r, r < HALF_D, stride_wr, stride_wc, HALF_D, HALF_DG,
                                   BLOCK_HDG)
            p1 += d1
            p2 += d2
    norm_rope_store(p1, p2, qn_ptr, gcs_ptr + n * stride_gcs, out_ptr + n * stride_on + h * stride_oh, eps,
                     HALF_DG, BLOCK_HDG)


@triton.jit
def _gate_query_partial_kernel(
    q_ptr, mcs_ptr, wq_ptr, ws_ptr,
    stride_qn, stride_qh, stride_mcs, stride_wh, stride_wg, stride_wr, stride_wc, stride_wsn, stride_wsh,
    G, UNITS_PER_HEAD,
    HALF_D: tl.constexpr, HALF_DG: tl.constexpr, CHUNK: tl.constexpr, BLOCK_HDG: tl.constexpr,
):
    """Program (n, h, u): unit u = (query head g, rows [k0, k0 + CHUNK)) -> ws[n, h, u, :2 * HALF_DG]."""
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    u = tl.program_id(2)
    g = u // UNITS_PER_HEAD
    r = (u % UNITS_PER_HEAD) * CHUNK + tl.arange(0, CHUNK)
    q_row = q_ptr + n * stride_qn + (h * G + g) * stride_qh
    w_g = wq_ptr + h * stride_wh + g * stride_wg
    d1, d2 = project_rows(q_row, mcs_ptr + n * stride_mcs, w_g, r, r < HALF_D, stride_wr, stride_wc, HALF_D,
                           HALF_DG, BLOCK_HDG)
    j = tl.arange(0, BLOCK_HDG)
    jm = j < HALF_DG
    w = ws_ptr + n * stride_wsn + h * stride_wsh + u * (2 * HALF_DG)
    tl.store(w + j, d1, mask=jm)
    tl.store(w + HALF_DG + j, d2, mask=jm)


@triton.jit
def _gate_query_finish_kernel(
    ws_ptr, qn_ptr, gcs_ptr, out_ptr,
    stride_wsn, stride_wsh, stride_gcs, stride_on, stride_oh,
    UNITS, eps,
    HALF_DG: tl.constexpr, BLOCK_HDG: tl.constexpr,
):
    """Program (n, h): the U partials summed in unit order (deterministic), RMSNorm, gate RoPE."""
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    j = tl.arange(0, BLOCK_HDG)
    jm = j < HALF_DG
    w = ws_ptr + n * stride_wsn + h * stride_wsh
    p1 = tl.zeros([BLOCK_HDG], tl.float32)
    p2 = tl.zeros([BLOCK_HDG], tl.float32)
    for u in range(UNITS):
        p1 += tl.load(w + u * (2 * HALF_DG) + j, mask=jm, other=0.0)
        p2 += tl.load(w + u * (2 * HALF_DG) + HALF_DG + j, mask=jm, other=0.0)
    norm_rope_store(p1, p2, qn_ptr, gcs_ptr + n * stride_gcs, out_ptr + n * stride_on + h * stride_oh, eps,
                     HALF_DG, BLOCK_HDG)


def split_units(g: int, d: int) -> tuple:
    """(units, rows per unit) of the split launch for G query heads per kv head and head dim D: each
    query head's D/2 rows (per RoPE half) in pieces of `_SPLIT_CHUNK`. From the geometry only (see the
    module doc: a graph's padded batch must split as the eager batch does)."""
    half_d = d // 2
    chunk = min(_SPLIT_CHUNK, triton.next_power_of_2(half_d))
    return g * triton.cdiv(half_d, chunk), chunk


def gate_query_workspace_numel(n: int, h_kv: int, g: int, d: int, dg: int) -> int:
    """fp32 elements of the split launch's scratch for N tokens (non-decreasing in N)."""
    return n * h_kv * split_units(g, d)[0] * dg


def gate_query_triton(
    q_post: torch.Tensor, model_cos_sin: torch.Tensor, w_q: torch.Tensor, q_norm: torch.Tensor,
    gate_cos_sin: torch.Tensor, out: Optional[torch.Tensor] = None, split: bool = True,
    workspace: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """`ops.gate.gate_query_post_rope` on CUDA (its docstring has the shapes).

    Kernel terms: q_post fp32/bf16/fp16, last axis contiguous (other strides free, e.g. a view into a fused qkv
    tensor); a magnitude in model_cos_sin (such as YaRN's mscale) is undone exactly; out last axis contiguous.
    split: two launches over `(N, H_kv, U)` then `(N, H_kv)` (see the module doc), else one over `(N, H_kv)`.
    workspace: optional fp32 buffer of at least `gate_query_workspace_numel(...)` elements for the split's
    partials (allocated when not given). No host syncs."""
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
    block_hdg = triton.next_power_of_2(dg // 2)
    if not split:
        _gate_query_kernel[(n, h_kv)](
            q_post, model_cos_sin, w_q, q_norm, gate_cos_sin, out,
            q_post.stride(0), q_post.stride(1), model_cos_sin.stride(0), gate_cos_sin.stride(0),
            w_q.stride(0), w_q.stride(1), w_q.stride(2), w_q.stride(3), out.stride(0), out.stride(1),
            g, GATE_NORM_EPS,
            HALF_D=half_d, HALF_DG=dg // 2, CHUNK=min(_MAX_CHUNK, triton.next_power_of_2(half_d)),
            BLOCK_HDG=block_hdg,
        )
        return out
    units, chunk = split_units(g, d)
    need = gate_query_workspace_numel(n, h_kv, g, d, dg)
    if workspace is None:
        workspace = torch.empty(need, dtype=torch.float32, device=q_post.device)
    elif workspace.dtype != torch.float32 or not workspace.is_contiguous() or workspace.numel() < need:
        raise ValueError(f"workspace must be a contiguous fp32 buffer of at least {need} elements")
    ws = workspace[:need].view(n, h_kv, units, dg)
    _gate_query_partial_kernel[(n, h_kv, units)](
        q_post, model_cos_sin, w_q, ws,
        q_post.stride(0), q_post.stride(1), model_cos_sin.stride(0),
        w_q.stride(0), w_q.stride(1), w_q.stride(2), w_q.stride(3), ws.stride(0), ws.stride(1),
        g, units // g,
        HALF_D=half_d, HALF_DG=dg // 2, CHUNK=chunk, BLOCK_HDG=block_hdg,
    )
    _gate_query_finish_kernel[(n, h_kv)](
        ws, q_norm, gate_cos_sin, out,
        ws.stride(0), ws.stride(1), gate_cos_sin.stride(0), out.stride(0), out.stride(1),
        units, GATE_NORM_EPS,
        HALF_DG=dg // 2, BLOCK_HDG=block_hdg,
    )
    return out
