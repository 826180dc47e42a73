"""4-bit key codes, the torch path (off CUDA, and the evaluation): every listed page at once. It drops the -1
entries by a boolean index (a host sync, dynamic shapes): CPU only; CUDA runs the fixed-shape kernel."""

from __future__ import annotations

import torch


def encode_pages_torch(k_buffer: torch.Tensor, pages: torch.Tensor, block_size: int, packed: torch.Tensor,
                       scales: torch.Tensor, k_scale: float = 1.0) -> None:
    """`ops.key_codes.encode_pages` (same arguments): the codes and scales of every listed page (pages < 0
    skipped) written in place."""
    keep = pages >= 0
    if not bool(keep.any()):
        return
    pages = pages[keep].long()
    n, h_kv, d = pages.numel(), k_buffer.shape[1], k_buffer.shape[2]
    slots = pages[:, None] * block_size + torch.arange(block_size, device=pages.device)  # [n, b]
    keys = k_buffer[slots].float() * k_scale  # [n, b, H_kv, D]
    lo = keys.amin(dim=1).half()  # [n, H_kv, D]
    step = ((keys.amax(dim=1) - lo.float()) / 15.0).half()
    x = (keys - lo.float()[:, None]) / step.float()[:, None] + 0.5
    codes = torch.where(step.float()[:, None] > 0, torch.floor(x).clamp(0, 15), 0.0).to(torch.uint8)
    codes = codes.permute(0, 2, 1, 3)  # [n, H_kv, b, D]
    byte = codes[..., : d // 2] | (codes[..., d // 2:] << 4)  # channel j and j + D / 2 share byte j
    packed[pages] = byte.reshape(n, h_kv, block_size * d // 2)
    scales[pages] = torch.stack([lo, step], dim=2)


def decode_pages_torch(packed: torch.Tensor, scales: torch.Tensor, pages: torch.Tensor, block_size: int,
                       heads: "torch.Tensor | None" = None) -> torch.Tensor:
    """`[..., H_kv, b, D]` fp32 keys of the pages `[...]` (int; entries < 0 read page 0, callers mask them); with
    `heads` (int, broadcastable to pages) `[..., b, D]`: each entry's own kv head only."""
    p = pages.clamp_min(0).long()
    if heads is not None:
        p, h = torch.broadcast_tensors(p, heads.long())
        byte, sc = packed[p, h], scales[p, h].float()  # [..., b * D / 2], [..., 2, D]
    else:
        byte, sc = packed[p], scales[p].float()  # [..., H_kv, b * D / 2], [..., H_kv, 2, D]
    byte = byte.view(*byte.shape[:-1], block_size, -1)
    codes = torch.cat([byte & 15, byte >> 4], dim=-1).float()  # [..., b, D]
    return sc[..., 0:1, :] + sc[..., 1:2, :] * codes
