"""Block scores, the plain statement (tests only): per request, its candidate blocks' pages read one by one
from the block table, each block's n run summaries scored against the gate query, the best run kept."""

from __future__ import annotations

import math

import torch


def score_blocks(gate_q: torch.Tensor, summaries: torch.Tensor, block_table: torch.Tensor,
                 num_candidates: torch.Tensor, block_size: int, max_blocks: int, sub_blocks: int = 1) -> torch.Tensor:
    """`[bs, H_kv, max_blocks]` fp32: `max_j gate_q[r, h] . summaries[block_table[r, m] // b, h, run j] / sqrt(Dg)`
    for m < num_candidates[r], -inf elsewhere. gate_q `[bs, H_kv, Dg]`; summaries `[num_pages, H_kv, n * Dg]`
    (run j in columns j*Dg .. (j+1)*Dg - 1, n = sub_blocks); block_table `[bs, >= max_blocks]`; num_candidates
    `[bs]`."""
    bs, h_kv, dg = gate_q.shape
    out = torch.full((bs, h_kv, max_blocks), float("-inf"), dtype=torch.float32, device=gate_q.device)
    for r in range(bs):
        for m in range(min(int(num_candidates[r]), max_blocks)):
            page = int(block_table[r, m]) // block_size
            runs = summaries[page].float().view(h_kv, sub_blocks, dg)  # [H_kv, n, Dg]
            out[r, :, m] = (runs * gate_q[r].float()[:, None, :]).sum(-1).amax(-1) / math.sqrt(dg)
    return out
