"""The exact second level, the plain statement (tests only): one (row, kv head) at a time, loops over blocks."""

from __future__ import annotations

from typing import Optional

import torch

from sas_backend.ops.key_codes.naive import decode_block
from sas_backend.ops.topk.naive import select_blocks


def rerank_blocks(q: torch.Tensor, k_buffer: torch.Tensor, first: torch.Tensor, block_table: torch.Tensor,
                  num_candidates: torch.Tensor, k: int, max_blocks: int, scale: float, block_size: int,
                  sink_blocks: int = 0, local_blocks: int = 0, anchors: Optional[torch.Tensor] = None,
                  k_scale: float = 1.0, key_codes=None) -> torch.Tensor:
    """`[bs, H_kv, k]` int32: of each row's first-level blocks `first` `[bs, H_kv, C]` (-1 padded), the k of
    highest exact attention mass among themselves, sink / local blocks and anchors (`[bs, H_kv, R]`) forced.

    Per (row r, kv head h) and query head j of h's group: the logits q[r, j] . (k_scale * K[t]) * scale of every
    token t of the first-level blocks, a block's log-mass = log-sum-exp of its tokens' logits minus that of all
    of them; the block scores the max of its log-mass over the group. Then `ops.topk.naive.select_blocks` over a
    `[bs, H_kv, max_blocks]` row holding those scores (-inf elsewhere, +inf at an anchor among them). `first` holds
    every forced block of its row (the first level's pick forced them in). key_codes: (packed, scales) of
    `ops.key_codes`: block b's keys are its page's codes decoded (`ops.key_codes.naive.decode_block`)."""
    bs, h_q, _ = q.shape
    h_kv = first.shape[1]
    g = h_q // h_kv
    wide = torch.full((bs, h_kv, max_blocks), float("-inf"))
    for r in range(bs):
        for h in range(h_kv):
            blocks = [int(b) for b in first[r, h].tolist() if b >= 0]
            if not blocks:
                continue
            lse = []  # per block: [G]
            for b in blocks:
                s0 = int(block_table[r, b])
                if key_codes is None:
                    keys = k_buffer[s0:s0 + block_size, h].double() * k_scale  # [b, D]
                else:
                    keys = _decoded(key_codes, s0 // block_size, h, block_size).double()
                logits = q[r, h * g:(h + 1) * g].double() @ keys.T * scale  # [G, b]
                lse.append(torch.logsumexp(logits, dim=1))
            lse = torch.stack(lse)  # [n, G]
            mass = (lse - torch.logsumexp(lse, dim=0, keepdim=True)).amax(dim=1)
            for b, s in zip(blocks, mass.tolist()):
                wide[r, h, b] = s
            if anchors is not None:
                for a in anchors[r, h].tolist():
                    if a in blocks:
                        wide[r, h, a] = float("inf")
    return select_blocks(wide, num_candidates.cpu(), k, sink_blocks, local_blocks)


def _decoded(key_codes, page: int, h: int, block_size: int) -> torch.Tensor:
    """`[b, D]` fp32 keys of one page and kv head from its packed codes (byte j: channel j low, j + D / 2 high)."""
    packed, scales = key_codes
    byte = packed[page, h].cpu().view(block_size, -1).long()
    codes = torch.cat([byte & 15, byte >> 4], dim=-1)
    return decode_block(codes, scales[page, h, 0].cpu(), scales[page, h, 1].cpu())
