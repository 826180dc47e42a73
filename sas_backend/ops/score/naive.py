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


def block_pages(
    req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, block_size: int, max_blocks: int
) -> torch.Tensor:
    """Physical page of each logical block `[bs, max_blocks]` (int64): slot of its first token // b."""
    first_slots = req_to_token[req_pool_indices.long(), : max_blocks * block_size : block_size]
    return torch.div(first_slots.long(), block_size, rounding_mode="floor")


def score_blocks(
    gate_q: torch.Tensor,
    summaries: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    max_blocks: int,
) -> torch.Tensor:
    """Scores of every candidate block, `-inf` elsewhere.

    gate_q: `[bs, H_kv, Dg]`; summaries: `[num_pages, H_kv, Dg]` (row = physical page);
    req_to_token: `[max_reqs, max_context]`; req_pool_indices, seq_lens: `[bs]`.
    Returns `[bs, H_kv, max_blocks]` fp32 with `s[r,h,m] = gate_q[r,h] . summaries[page(r,m),h] / sqrt(Dg)`
    for m < candidate_counts(seq_lens)[r].
    """
    bs, h_kv, dg = gate_q.shape
    pages = block_pages(req_to_token, req_pool_indices, block_size, max_blocks)  # [bs, M]
    kg = summaries[pages].float()  # [bs, M, H_kv, Dg]
    scores = torch.einsum("bhd,bmhd->bhm", gate_q.float(), kg) / math.sqrt(dg)
    n_cand = candidate_counts(seq_lens, block_size)
    valid = torch.arange(max_blocks, device=gate_q.device)[None, :] < n_cand[:, None]
    return scores.masked_fill(~valid[:, None, :], float("-inf"))
