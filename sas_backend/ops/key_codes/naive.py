"""4-bit key codes of a block, the plain statement (tests only): one (page, kv head, channel) at a time."""

from __future__ import annotations

import torch


def encode_block(keys: torch.Tensor) -> "tuple[torch.Tensor, torch.Tensor, torch.Tensor]":
    """(codes `[b, D]` int64 in 0..15, lo `[D]` fp16, step `[D]` fp16) of one block's keys `[b, D]` (any float
    dtype, read as fp32). Per channel c: lo = the block's min rounded to fp16; step = (max - lo) / 15 in fp32,
    rounded to fp16 (0 when the channel is constant); code = floor((key - lo) / step + 0.5) in fp32, clamped to
    0..15 (0 where step is 0), computed from the fp16 lo and step a reader decodes with."""
    b, d = keys.shape
    codes = torch.zeros(b, d, dtype=torch.int64)
    lo = torch.zeros(d, dtype=torch.float16)
    step = torch.zeros(d, dtype=torch.float16)
    for c in range(d):
        col = keys[:, c].float()
        lo32 = min(col.tolist())
        lo16 = torch.tensor(lo32, dtype=torch.float32).half()
        st16 = ((torch.tensor(max(col.tolist()), dtype=torch.float32) - lo16.float()) / 15.0).half()
        lo[c], step[c] = lo16, st16
        for t in range(b):
            if float(st16) > 0:
                x = (col[t] - lo16.float()) / st16.float() + 0.5  # fp32, as every path computes it
                codes[t, c] = min(15, max(0, int(torch.floor(x))))
    return codes, lo, step


def decode_block(codes: torch.Tensor, lo: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """`[b, D]` fp32 keys of one block's codes `[b, D]`: lo + step * code per channel."""
    return lo.float()[None, :] + step.float()[None, :] * codes.float()


def pack(codes: torch.Tensor) -> torch.Tensor:
    """`[b, D / 2]` uint8 of codes `[b, D]`: byte j of token t holds channel j in its low nibble, j + D / 2 in its
    high one."""
    b, d = codes.shape
    out = torch.zeros(b, d // 2, dtype=torch.uint8)
    for t in range(b):
        for j in range(d // 2):
            out[t, j] = int(codes[t, j]) | (int(codes[t, j + d // 2]) << 4)
    return out


def encode_pages(k_buffer: torch.Tensor, pages, block_size: int, k_scale: float = 1.0):
    """{page: (packed `[H_kv, b * D / 2]` uint8, scales `[H_kv, 2, D]` fp16 (lo, step))} of the listed pages, each
    page's keys k_buffer[page * b:(page + 1) * b] `[b, H_kv, D]` times k_scale (an fp8 cache holds K / k_scale)."""
    out = {}
    for page in pages:
        keys = k_buffer[page * block_size:(page + 1) * block_size].float() * k_scale  # [b, H_kv, D]
        packed, scales = [], []
        for h in range(keys.shape[1]):
            codes, lo, step = encode_block(keys[:, h])
            packed.append(pack(codes).reshape(-1))
            scales.append(torch.stack([lo, step]))
        out[int(page)] = (torch.stack(packed), torch.stack(scales))
    return out
