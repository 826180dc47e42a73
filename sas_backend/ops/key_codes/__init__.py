"""4-bit codes of each complete block's keys, for a second level that reads a quarter of the key bytes: ONE entry
point, the Triton kernel on CUDA, torch elsewhere.

A page (one block of b tokens) stores, per kv head, its keys as 4-bit codes (`[b * D / 2]` uint8, channel j in the
low nibble of byte j of a token, channel j + D / 2 in the high one: RoPE's two halves share a byte, so each half is
read contiguously and a program owning a slice of both halves, as the fused front's units do, writes whole bytes)
and per channel the block's min and step in fp16
(`[2, D]`): key = lo + step * code, within step / 2 of the key. b x D / 2 + 4 x D bytes a page and kv head
(b = 64, D = 128: 4608, 0.28 of the bf16 keys). KIVI's grouping (keys per channel: their outlier channels keep
their own range). Measured as the second level's keys (`hf.candidates`' `gatec<X>exactq4`,
bench/results/2026-12-07-quantized-rerank): the same ranking quality as bf16 keys.

- `encode_pages(k_buffer, pages, block_size, packed, scales, k_scale)`: write the listed pages' codes.
- `decode_pages(packed, scales, pages, block_size)`: their keys, fp32 (the torch path's readers, tests).
- `code_bytes(block_size, head_dim)`: bytes a page and kv head.

`naive` is the plain statement (tests); `torch_path` the torch path; `triton` the kernel (imported on first CUDA use
only).
"""

from __future__ import annotations

from typing import Optional

import torch

from sas_backend.ops.key_codes.torch_path import decode_pages_torch, encode_pages_torch


def code_bytes(block_size: int, head_dim: int) -> int:
    """Bytes a page holds per kv head: the codes (b x D / 2) and the fp16 lo and step of each channel (4 x D)."""
    return block_size * head_dim // 2 + 4 * head_dim


def encode_pages(k_buffer: torch.Tensor, pages: torch.Tensor, block_size: int, packed: torch.Tensor,
                 scales: torch.Tensor, k_scale: float = 1.0, kernel: Optional[bool] = None) -> None:
    """Write the 4-bit codes of the listed pages' keys; fixed shapes, no host sync on CUDA.

    k_buffer `[slots, H_kv, D]` (any float dtype; an fp8 cache holds K / k_scale, so the codes hold K); pages `[n]`
    int physical pages (page p = slots p * b .. p * b + b - 1, a complete block; entries < 0 skipped); packed
    `[num_pages, H_kv, b * D / 2]` uint8 and scales `[num_pages, H_kv, 2, D]` fp16 (lo, step), written at the
    listed pages only. D even; keys within fp16's range. The Triton kernel on CUDA (kernel None; True: also on
    CPU, in Triton's interpreter).
    """
    h_kv, d = k_buffer.shape[1], k_buffer.shape[2]
    if d % 2:
        raise ValueError(f"head_dim {d} must be even (two channels a byte)")
    if packed.dtype != torch.uint8 or tuple(packed.shape[1:]) != (h_kv, block_size * d // 2):
        raise ValueError(f"packed {tuple(packed.shape)} {packed.dtype}: want [pages, {h_kv}, {block_size * d // 2}] "
                         "uint8")
    if scales.dtype != torch.float16 or tuple(scales.shape[1:]) != (h_kv, 2, d) or scales.shape[0] != packed.shape[0]:
        raise ValueError(f"scales {tuple(scales.shape)} {scales.dtype}: want [{packed.shape[0]}, {h_kv}, 2, {d}] "
                         "float16")
    if not (packed.is_contiguous() and scales.is_contiguous() and k_buffer.stride(-1) == 1):
        raise ValueError("packed and scales must be contiguous, k_buffer's last axis too")
    if k_buffer.is_cuda if kernel is None else kernel:
        from sas_backend.ops.key_codes.triton import encode_pages_triton

        return encode_pages_triton(k_buffer, pages, block_size, packed, scales, k_scale)
    return encode_pages_torch(k_buffer, pages, block_size, packed, scales, k_scale)


def decode_pages(packed: torch.Tensor, scales: torch.Tensor, pages: torch.Tensor, block_size: int,
                 heads: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`[..., H_kv, b, D]` fp32 keys of pages `[...]` (entries < 0 read page 0: mask them): lo + step * code; with
    `heads` (broadcastable to pages) `[..., b, D]`, each entry's own kv head."""
    return decode_pages_torch(packed, scales, pages, block_size, heads)


__all__ = ["code_bytes", "decode_pages", "encode_pages"]
