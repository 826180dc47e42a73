"""Block scores (plain torch): gate query against the paged block summaries of each request."""

from __future__ import annotations

import math

import torch


def candidate_counts(seq_lens: torch.Tensor, block_size: int) -> torch.Tensor:
    """Number of candidate blocks per request `[bs]`: the complete blocks before the current one.

    The current block holds the newest token (position seq_len - 1), so it is
    `(seq_len - 1) // block_size` and every block before it is complete.
    """
    return torch.div(seq_lens - 1, block_size, rounding_mode="floor").clamp_min(0)


def score_blocks(
    gate_q: torch.Tensor, summaries: torch.Tensor, block_table: torch.Tensor, num_candidates: torch.Tensor,
    block_size: int, max_blocks: int, sub_blocks: int = 1,
) -> torch.Tensor:
    """Scores of every candidate block, `-inf` elsewhere.

    gate_q: `[bs, H_kv, Dg]`; summaries: `[num_pages, H_kv, n * Dg]` (row = physical page; n = sub_blocks
    summaries of a block's runs side by side, run j in columns j*Dg .. (j+1)*Dg - 1);
    block_table: `[bs, >= max_blocks]` KV slot of each logical block's first token (a page is one
    block, so block m lives in page block_table[r, m] // b); num_candidates: `[bs]`.
    Returns `[bs, H_kv, max_blocks]` fp32 with `s[r,h,m] = max_j gate_q[r,h] . summaries[page(r,m),h,run j] / sqrt(Dg)`
    for m < num_candidates[r].
    """
    bs, h_kv, dg = gate_q.shape
    pages = torch.div(block_table[:, :max_blocks].long(), block_size, rounding_mode="floor")  # [bs, M]
    kg = summaries[pages].float()  # [bs, M, H_kv, n * Dg]
    if sub_blocks == 1:
        scores = torch.einsum("bhd,bmhd->bhm", gate_q.float(), kg)
    else:  # a broadcast product: einsum's bmm would first copy the [bs, M, H_kv, n, Dg] runs into its layout
        runs = (kg.unflatten(-1, (sub_blocks, dg)) * gate_q.float()[:, None, :, None, :]).sum(-1)  # [bs, M, H, n]
        scores = runs.amax(dim=-1).transpose(1, 2)
    scores = scores / math.sqrt(dg)
    valid = torch.arange(max_blocks, device=gate_q.device)[None, :] < num_candidates[:, None]
    return scores.masked_fill(~valid[:, None, :], float("-inf"))
