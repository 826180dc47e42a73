"""Block summaries (Triton), fused: read post-RoPE keys from the paged cache, undo the model's
RoPE, max/min/mean pool, project with w_k[h], RMSNorm, gate RoPE at the block start.

Same results as `sas_backend.ops.summary.torch_path.summarize_pages` / `naive.summary_update_decode` /
`torch_path.summarize_listed`.
One program per (tile of 16 blocks, kv head): the 16 pooled rows go through the projection as
`tl.dot`s (fp32, IEEE precision), so w_k[h] is read once per tile rather than once per block.
Vectors are processed as their two RoPE halves (neox layout, see `sas_backend.ops.rope`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sas_backend.ops.gate import GATE_NORM_EPS

_TILE_BLOCKS = 16  # blocks per program; tl.dot needs at least 16 rows


@triton.jit
def _w_dot(
    a, acc, w_ptr, row0, col0, stride_wr, stride_wc, HALF_D, HALF_DG,
    BLOCK_HD: tl.constexpr, BLOCK_HDG: tl.constexpr,
):
    """acc + a `[BN, BLOCK_HD]` @ w[row0 : row0+HALF_D, col0 : col0+HALF_DG], fp32."""
    i = tl.arange(0, BLOCK_HD)
    j = tl.arange(0, BLOCK_HDG)
    w = tl.load(
        w_ptr + (row0 + i)[:, None] * stride_wr + (col0 + j)[None, :] * stride_wc,
        mask=(i < HALF_D)[:, None] & (j < HALF_DG)[None, :],
        other=0.0,
    ).to(tl.float32)
    return tl.dot(a, w, acc, input_precision="ieee")


@triton.jit
def _summarize_tile(
    k_ptr,
    out_ptr,
    mcs_ptr,
    gcs_ptr,
    wk_ptr,
    kn_ptr,
    pages,
    starts,
    out_rows,
    row_ok,
    h,
    stride_ks,
    stride_kh,
    stride_os,
    stride_oh,
    stride_mcs,
    stride_gcs,
    stride_wh,
    stride_wr,
    stride_wc,
    eps,
    k_scale,
    n_tok,
    n_seg,
    BLOCK_SIZE: tl.constexpr,
    HALF_D: tl.constexpr,
    HALF_DG: tl.constexpr,
    BLOCK_HD: tl.constexpr,
    BLOCK_HDG: tl.constexpr,
    BN: tl.constexpr,
):
    """Summaries of the BN blocks (pages, starts: `[BN]` int64) of kv head h -> out[out_rows, h]."""
    d = tl.arange(0, BLOCK_HD)
    lmask = row_ok[:, None] & (d < HALF_D)[None, :]
    # Masked lanes load 0, so padded columns pool to exactly 0 and add nothing to the dots.
    mx1 = tl.full([BN, BLOCK_HD], float("-inf"), tl.float32)
    mx2 = tl.full([BN, BLOCK_HD], float("-inf"), tl.float32)
    mn1 = tl.full([BN, BLOCK_HD], float("inf"), tl.float32)
    mn2 = tl.full([BN, BLOCK_HD], float("inf"), tl.float32)
    sm1 = tl.zeros([BN, BLOCK_HD], tl.float32)
    sm2 = tl.zeros([BN, BLOCK_HD], tl.float32)
    # A runtime trip count: with the constexpr one the compiler unrolls all b steps and hoists
    # their loads, which spills kilobytes per thread.
    for t in range(n_tok):
        # Token t of the block sits in slot page*b + t, at position start + t.
        kp = k_ptr + ((pages * BLOCK_SIZE + t) * stride_ks + h * stride_kh)[:, None] + d[None, :]
        x1 = tl.load(kp, mask=lmask, other=0.0).to(tl.float32) * k_scale  # dequantized (fp8 holds K / k_scale)
        x2 = tl.load(kp + HALF_D, mask=lmask, other=0.0).to(tl.float32) * k_scale
        cp = mcs_ptr + ((starts + t) * stride_mcs)[:, None] + d[None, :]
        c = tl.load(cp, mask=lmask, other=1.0).to(tl.float32)  # masked lanes: identity, no 0/0
        s = tl.load(cp + HALF_D, mask=lmask, other=0.0).to(tl.float32)
        # Inverse rotation (angle -theta) recovers the pre-RoPE key; dividing by cos^2 + sin^2
        # also undoes a magnitude baked into the table (YaRN's mscale), as ops.rope.invert_rope does.
        inv_norm = 1.0 / (c * c + s * s)
        y1 = (x1 * c + x2 * s) * inv_norm
        y2 = (x2 * c - x1 * s) * inv_norm
        mx1 = tl.maximum(mx1, y1)
        mx2 = tl.maximum(mx2, y2)
        mn1 = tl.minimum(mn1, y1)
        mn2 = tl.minimum(mn2, y2)
        sm1 += y1
        sm2 += y2
    av1 = sm1 / BLOCK_SIZE
    av2 = sm2 / BLOCK_SIZE

    # Project cat(max, min, mean) [3D] with w_k[h] [3D, Dg]: six row segments of D/2 (the RoPE
    # halves of each statistic), two output halves. A runtime loop over segments keeps only two
    # w tiles live at a time (unrolled, every tile load is hoisted and spills).
    w_ptr = wk_ptr + h * stride_wh
    p1 = tl.zeros([BN, BLOCK_HDG], tl.float32)
    p2 = tl.zeros([BN, BLOCK_HDG], tl.float32)
    for seg in range(n_seg):
        a = tl.where(seg == 4, av1, av2)
        a = tl.where(seg == 3, mn2, a)
        a = tl.where(seg == 2, mn1, a)
        a = tl.where(seg == 1, mx2, a)
        a = tl.where(seg == 0, mx1, a)
        row0 = seg * HALF_D
        p1 = _w_dot(a, p1, w_ptr, row0, 0, stride_wr, stride_wc, HALF_D, HALF_DG, BLOCK_HD, BLOCK_HDG)
        p2 = _w_dot(a, p2, w_ptr, row0, HALF_DG, stride_wr, stride_wc, HALF_D, HALF_DG, BLOCK_HD, BLOCK_HDG)

    # RMSNorm over Dg in fp32 (padded columns are 0).
    j = tl.arange(0, BLOCK_HDG)
    jm = j < HALF_DG
    var = (tl.sum(p1 * p1, axis=1) + tl.sum(p2 * p2, axis=1)) / (2 * HALF_DG)
    inv = tl.rsqrt(var + eps)
    g1 = tl.load(kn_ptr + j, mask=jm, other=0.0).to(tl.float32)
    g2 = tl.load(kn_ptr + HALF_DG + j, mask=jm, other=0.0).to(tl.float32)
    n1 = p1 * inv[:, None] * g1[None, :]
    n2 = p2 * inv[:, None] * g2[None, :]

    # Gate RoPE at the block's first position.
    smask = row_ok[:, None] & jm[None, :]
    gp = gcs_ptr + (starts * stride_gcs)[:, None] + j[None, :]
    c = tl.load(gp, mask=smask, other=0.0).to(tl.float32)
    s = tl.load(gp + HALF_DG, mask=smask, other=0.0).to(tl.float32)
    o1 = n1 * c - n2 * s
    o2 = n2 * c + n1 * s
    op = out_ptr + (out_rows * stride_os + h * stride_oh)[:, None] + j[None, :]
    tl.store(op, o1.to(out_ptr.dtype.element_ty), mask=smask)
    tl.store(op + HALF_DG, o2.to(out_ptr.dtype.element_ty), mask=smask)


@triton.jit
def _summarize_pages_kernel(
    k_ptr, out_ptr, mcs_ptr, gcs_ptr, wk_ptr, kn_ptr, pages_ptr, starts_ptr, N,
    stride_ks, stride_kh, stride_os, stride_oh, stride_mcs, stride_gcs, stride_wh, stride_wr, stride_wc,
    eps, k_scale, n_tok, n_seg,
    BLOCK_SIZE: tl.constexpr, HALF_D: tl.constexpr, HALF_DG: tl.constexpr,
    BLOCK_HD: tl.constexpr, BLOCK_HDG: tl.constexpr, BN: tl.constexpr,
):
    h = tl.program_id(1)
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    ok = rows < N
    pages = tl.load(pages_ptr + rows, mask=ok, other=0).to(tl.int64)
    starts = tl.load(starts_ptr + rows, mask=ok, other=0).to(tl.int64)
    _summarize_tile(
        k_ptr, out_ptr, mcs_ptr, gcs_ptr, wk_ptr, kn_ptr, pages, starts, rows.to(tl.int64), ok, h,
        stride_ks, stride_kh, stride_os, stride_oh, stride_mcs, stride_gcs, stride_wh, stride_wr, stride_wc,
        eps, k_scale, n_tok, n_seg,
        BLOCK_SIZE, HALF_D, HALF_DG, BLOCK_HD, BLOCK_HDG, BN,
    )


@triton.jit
def _summary_update_decode_kernel(
    k_ptr, out_ptr, mcs_ptr, gcs_ptr, wk_ptr, kn_ptr, bt_ptr, seq_ptr, bs, stride_bt,
    stride_ks, stride_kh, stride_os, stride_oh, stride_mcs, stride_gcs, stride_wh, stride_wr, stride_wc,
    eps, k_scale, n_tok, n_seg,
    BLOCK_SIZE: tl.constexpr, HALF_D: tl.constexpr, HALF_DG: tl.constexpr,
    BLOCK_HD: tl.constexpr, BLOCK_HDG: tl.constexpr, BN: tl.constexpr,
):
    h = tl.program_id(1)
    r = tl.program_id(0) * BN + tl.arange(0, BN)
    seq_len = tl.load(seq_ptr + r, mask=r < bs, other=0).to(tl.int64)
    # The newest token completed block seq_len // b - 1 exactly when seq_len % b == 0.
    done = (r < bs) & (seq_len > 0) & (seq_len % BLOCK_SIZE == 0)
    block = tl.where(done, seq_len // BLOCK_SIZE - 1, 0)
    starts = block * BLOCK_SIZE
    slot = tl.load(bt_ptr + r.to(tl.int64) * stride_bt + block, mask=done, other=0).to(tl.int64)
    pages = slot // BLOCK_SIZE
    # Most steps complete no block: skip the projection entirely then.
    if tl.sum(done.to(tl.int32), axis=0) > 0:
        _summarize_tile(
            k_ptr, out_ptr, mcs_ptr, gcs_ptr, wk_ptr, kn_ptr, pages, starts, pages, done, h,
            stride_ks, stride_kh, stride_os, stride_oh, stride_mcs, stride_gcs,
            stride_wh, stride_wr, stride_wc, eps, k_scale, n_tok, n_seg,
            BLOCK_SIZE, HALF_D, HALF_DG, BLOCK_HD, BLOCK_HDG, BN,
        )


@triton.jit
def _summarize_listed_kernel(
    k_ptr, out_ptr, mcs_ptr, gcs_ptr, wk_ptr, kn_ptr, pages_ptr, starts_ptr, count_ptr, n_programs,
    stride_ks, stride_kh, stride_os, stride_oh, stride_mcs, stride_gcs, stride_wh, stride_wr, stride_wc,
    eps, k_scale, n_tok, n_seg,
    N_SUB: tl.constexpr, BLOCK_SIZE: tl.constexpr, HALF_D: tl.constexpr, HALF_DG: tl.constexpr,
    BLOCK_HD: tl.constexpr, BLOCK_HDG: tl.constexpr, BN: tl.constexpr,
):
    # Persistent: a fixed grid (capturable) strides over tiles of BN runs; the run count is read on the device, so
    # a step with nothing listed costs each program one load. Run r is run j = r % N_SUB of listed block r // N_SUB:
    # BLOCK_SIZE (the run's tokens) apart in its page, N_SUB runs a page, written at column j * Dg of its row.
    h = tl.program_id(1)
    n_runs = tl.load(count_ptr).to(tl.int32) * N_SUB
    for tile in range(tl.program_id(0), tl.cdiv(n_runs, BN), n_programs):
        r = tile * BN + tl.arange(0, BN)
        ok = r < n_runs
        e = r // N_SUB
        j = (r % N_SUB).to(tl.int64)
        page = tl.load(pages_ptr + e, mask=ok, other=0).to(tl.int64)
        start = tl.load(starts_ptr + e, mask=ok, other=0).to(tl.int64) + j * BLOCK_SIZE
        out_at = page * stride_os + j * (2 * HALF_DG)  # element offsets: passed with a row stride of 1
        _summarize_tile(
            k_ptr, out_ptr, mcs_ptr, gcs_ptr, wk_ptr, kn_ptr, page * N_SUB + j, start, out_at, ok, h,
            stride_ks, stride_kh, 1, stride_oh, stride_mcs, stride_gcs, stride_wh, stride_wr, stride_wc,
            eps, k_scale, n_tok, n_seg,
            BLOCK_SIZE, HALF_D, HALF_DG, BLOCK_HD, BLOCK_HDG, BN,
        )


def _check_geometry(k_buffer, model_cos_sin, gate_cos_sin, w_k, k_norm):
    """Validate shapes; return (H_kv, D, Dg)."""
    _, h_kv, d = k_buffer.shape
    dg = w_k.shape[-1]
    if w_k.shape != (h_kv, 3 * d, dg):
        raise ValueError(f"w_k {tuple(w_k.shape)} does not fit keys [.., {h_kv}, {d}]: want [H_kv, 3D, Dg]")
    if d % 2 or dg % 2:
        raise ValueError(f"RoPE needs even dims, got D={d}, Dg={dg}")
    if model_cos_sin.shape[-1] != d or gate_cos_sin.shape[-1] != dg or k_norm.shape != (dg,):
        raise ValueError("model_cos_sin must be [max_pos, D], gate_cos_sin [max_pos, Dg], k_norm [Dg]")
    if k_buffer.stride(-1) != 1:
        raise ValueError("k_buffer must be contiguous along its last axis")
    return h_kv, d, dg


def _meta(block_size: int, d: int, dg: int) -> dict:
    return dict(
        BLOCK_SIZE=block_size,
        HALF_D=d // 2,
        HALF_DG=dg // 2,
        BLOCK_HD=max(16, triton.next_power_of_2(d // 2)),
        BLOCK_HDG=max(16, triton.next_power_of_2(dg // 2)),
        BN=_TILE_BLOCKS,
        num_warps=8,  # fp32 FMA dots: 8 warps stay within registers (4 spill)
    )


def _last_contig(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def summarize_pages_triton(
    k_buffer: torch.Tensor, pages: torch.Tensor, block_starts: torch.Tensor, model_cos_sin: torch.Tensor,
    gate_cos_sin: torch.Tensor, w_k: torch.Tensor, k_norm: torch.Tensor, block_size: int, k_scale: float = 1.0,
) -> torch.Tensor:
    """`ops.summary.summarize_pages` on CUDA (its docstring has the shapes); k_buffer fp32/bf16/fp16/fp8."""
    h_kv, d, dg = _check_geometry(k_buffer, model_cos_sin, gate_cos_sin, w_k, k_norm)
    n = pages.numel()
    out = torch.empty(n, h_kv, dg, dtype=torch.float32, device=k_buffer.device)
    if n == 0 or h_kv == 0:
        return out
    mcs, gcs = _last_contig(model_cos_sin), _last_contig(gate_cos_sin)
    k_norm = _last_contig(k_norm)
    grid = (triton.cdiv(n, _TILE_BLOCKS), h_kv)
    _summarize_pages_kernel[grid](
        k_buffer, out, mcs, gcs, w_k, k_norm, pages.reshape(-1), block_starts.reshape(-1), n,
        k_buffer.stride(0), k_buffer.stride(1), out.stride(0), out.stride(1),
        mcs.stride(0), gcs.stride(0), w_k.stride(0), w_k.stride(1), w_k.stride(2),
        GATE_NORM_EPS, float(k_scale), block_size, 6,
        **_meta(block_size, d, dg),
    )
    return out


def summary_update_decode_triton(
    k_buffer: torch.Tensor, summaries_out: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
    block_size: int, model_cos_sin: torch.Tensor, gate_cos_sin: torch.Tensor, w_k: torch.Tensor, k_norm: torch.Tensor,
    k_scale: float = 1.0,
) -> torch.Tensor:
    """`ops.summary.update_summaries` on CUDA (its docstring has the shapes); capturable.

    Requests that completed no block write NOTHING (not even the padding row 0), so CUDA-graph padding entries
    are harmless. summaries_out fp32 or bf16, last axis contiguous; block_table last axis contiguous; seq_lens
    on device (no host sync, no allocation)."""
    h_kv, d, dg = _check_geometry(k_buffer, model_cos_sin, gate_cos_sin, w_k, k_norm)
    if summaries_out.shape[1:] != (h_kv, dg) or summaries_out.stride(-1) != 1:
        raise ValueError(
            f"summaries_out {tuple(summaries_out.shape)} must be [num_pages+1, {h_kv}, {dg}]"
            " with a contiguous last axis"
        )
    if block_table.stride(-1) != 1:
        raise ValueError("block_table must be contiguous along its last axis")
    bs = seq_lens.numel()
    if bs == 0 or h_kv == 0:
        return summaries_out
    mcs, gcs = _last_contig(model_cos_sin), _last_contig(gate_cos_sin)
    k_norm = _last_contig(k_norm)
    grid = (triton.cdiv(bs, _TILE_BLOCKS), h_kv)
    _summary_update_decode_kernel[grid](
        k_buffer, summaries_out, mcs, gcs, w_k, k_norm, block_table, seq_lens,
        bs, block_table.stride(0),
        k_buffer.stride(0), k_buffer.stride(1), summaries_out.stride(0), summaries_out.stride(1),
        mcs.stride(0), gcs.stride(0), w_k.stride(0), w_k.stride(1), w_k.stride(2),
        GATE_NORM_EPS, float(k_scale), block_size, 6,
        **_meta(block_size, d, dg),
    )
    return summaries_out


def summarize_listed_triton(
    k_buffer: torch.Tensor, summaries_out: torch.Tensor, pages: torch.Tensor, starts: torch.Tensor,
    count: torch.Tensor, block_size: int, model_cos_sin: torch.Tensor, gate_cos_sin: torch.Tensor, w_k: torch.Tensor,
    k_norm: torch.Tensor, k_scale: float = 1.0, sub_blocks: int = 1, programs: "int | None" = None,
) -> torch.Tensor:
    """`ops.summary.summarize_listed` on CUDA (its docstring has the shapes); capturable: a fixed grid of
    `programs` x H_kv persistent programs (default: enough to fill the device's SMs) reads `count` on the device."""
    h_kv, d, dg = _check_geometry(k_buffer, model_cos_sin, gate_cos_sin, w_k, k_norm)
    if summaries_out.shape[1:] != (h_kv, sub_blocks * dg) or summaries_out.stride(-1) != 1:
        raise ValueError(f"summaries_out {tuple(summaries_out.shape)} must be [num_pages, {h_kv}, {sub_blocks * dg}] "
                         "with a contiguous last axis")
    if block_size % sub_blocks:
        raise ValueError(f"sub_blocks {sub_blocks} must divide the block size {block_size}")
    if h_kv == 0 or pages.numel() == 0:
        return summaries_out
    if programs is None:
        sms = torch.cuda.get_device_properties(k_buffer.device).multi_processor_count if k_buffer.is_cuda else 2
        programs = max(1, 2 * sms // h_kv)
    mcs, gcs = _last_contig(model_cos_sin), _last_contig(gate_cos_sin)
    k_norm = _last_contig(k_norm)
    size = block_size // sub_blocks
    _summarize_listed_kernel[(programs, h_kv)](
        k_buffer, summaries_out, mcs, gcs, w_k, k_norm, pages, starts, count, programs,
        k_buffer.stride(0), k_buffer.stride(1), summaries_out.stride(0), summaries_out.stride(1),
        mcs.stride(0), gcs.stride(0), w_k.stride(0), w_k.stride(1), w_k.stride(2),
        GATE_NORM_EPS, float(k_scale), size, 6, N_SUB=sub_blocks,
        **_meta(size, d, dg),
    )
    return summaries_out
