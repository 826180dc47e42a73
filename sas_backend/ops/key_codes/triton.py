"""4-bit key codes as ONE Triton launch, grid `(n, H_kv)`: program (i, h) reads page `pages[i]`'s keys of kv head h
as two `[b, D / 2]` tiles (RoPE's two halves, which share a byte), takes each channel's min and max, rounds min and
step to fp16 and writes the codes (the first half's channel in the low nibble) and the scales. fp32 arithmetic
with IEEE division (`tl.math.div_rn`), so a code equals the torch path's."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sas_backend.ops.fused_step import _pow2


@triton.jit
def quantize_columns(x):
    """(codes `[T, C]` int32 in 0..15, lo `[C]` fp16, step `[C]` fp16) of a key tile `[T, C]` fp32, per column over
    its T tokens: `naive.encode_block`'s rule (the fused front's block step writes codes with it too)."""
    lo = tl.min(x, axis=0).to(tl.float16)
    step = tl.math.div_rn(tl.max(x, axis=0) - lo.to(tl.float32), 15.0).to(tl.float16)
    lo32 = lo.to(tl.float32)
    st32 = step.to(tl.float32)
    safe = tl.where(st32 > 0, st32, 1.0)
    code = tl.minimum(tl.maximum(tl.floor(tl.math.div_rn(x - lo32[None, :], safe[None, :]) + 0.5), 0.0), 15.0)
    return tl.where((st32 > 0)[None, :], code, 0.0).to(tl.int32), lo, step


@triton.jit
def _encode_pages_kernel(
    k_ptr, pages_ptr, packed_ptr, scales_ptr,
    stride_ks, stride_kh, stride_pp, stride_ph, stride_sp, stride_sh, k_scale,
    HALF_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_HD: tl.constexpr,
):
    i = tl.program_id(0)
    h = tl.program_id(1)
    page = tl.load(pages_ptr + i).to(tl.int64)
    if page >= 0:
        t = tl.arange(0, BLOCK_SIZE)
        j = tl.arange(0, BLOCK_HD)
        jm = j < HALF_D
        base = k_ptr + (page * BLOCK_SIZE + t)[:, None].to(tl.int64) * stride_ks + h * stride_kh
        out = packed_ptr + page * stride_pp + h * stride_ph + t[:, None] * HALF_D + j[None, :]
        byte = tl.zeros([BLOCK_SIZE, BLOCK_HD], tl.int32)
        for half in tl.static_range(2):
            keys = tl.load(base + (j + half * HALF_D)[None, :], mask=jm[None, :], other=0.0).to(tl.float32) * k_scale
            code, lo, step = quantize_columns(keys)
            byte = byte | (code << (4 * half))
            srow = scales_ptr + page * stride_sp + h * stride_sh + j + half * HALF_D
            tl.store(srow, lo, mask=jm)
            tl.store(srow + 2 * HALF_D, step, mask=jm)
        tl.store(out, byte.to(tl.uint8), mask=jm[None, :])


def encode_pages_triton(k_buffer: torch.Tensor, pages: torch.Tensor, block_size: int, packed: torch.Tensor,
                        scales: torch.Tensor, k_scale: float = 1.0) -> None:
    """`ops.key_codes.encode_pages` as one launch (same arguments)."""
    n, h_kv, d = pages.numel(), k_buffer.shape[1], k_buffer.shape[2]
    if n == 0:
        return
    _encode_pages_kernel[(n, h_kv)](
        k_buffer, pages, packed, scales,
        k_buffer.stride(0), k_buffer.stride(1), packed.stride(0), packed.stride(1), scales.stride(0),
        scales.stride(1), float(k_scale),
        HALF_D=d // 2, BLOCK_SIZE=block_size, BLOCK_HD=max(16, _pow2(d // 2)),
        num_warps=8 if block_size * d >= 8192 else 4,  # a [64, 64] fp32 tile at 4 warps took 254 registers (sm_90)
    )


__all__ = ["_encode_pages_kernel", "encode_pages_triton", "quantize_columns"]
