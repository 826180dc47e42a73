"""Top-K block selection (plain torch), per (request, kv head)."""

from __future__ import annotations

import torch


def forced_mask(
    num_candidates: torch.Tensor, max_blocks: int, sink_blocks: int, local_blocks: int
) -> torch.Tensor:
    """`[bs, max_blocks]` bool: candidate blocks forced in (the first `sink_blocks` blocks and the
    `local_blocks` blocks right before the current one)."""
    m = torch.arange(max_blocks, device=num_candidates.device)[None, :]
    n = num_candidates[:, None]
    sink = m < sink_blocks
    local = m >= n - local_blocks
    return (sink | local) & (m < n)


def forced_tier(
    num_candidates: torch.Tensor, max_blocks: int, sink_blocks: int, local_blocks: int
) -> torch.Tensor:
    """`[bs, max_blocks]` int64 priority tier: 2 = sink, 1 = local, 0 = chosen by score.

    A block that is both sink and local is a sink. Tiers matter when more blocks are forced
    than K: sink blocks are kept first (lowest index first), then local blocks nearest the
    current block first, then blocks by score. Forced blocks outrank every score, +inf included.
    """
    forced = forced_mask(num_candidates, max_blocks, sink_blocks, local_blocks)
    m = torch.arange(max_blocks, device=num_candidates.device)[None, :]
    sink = (m < sink_blocks) & forced
    return torch.where(sink, 2, torch.where(forced, 1, 0)).to(torch.int64)


def select_blocks(
    scores: torch.Tensor,
    num_candidates: torch.Tensor,
    k: int,
    sink_blocks: int = 0,
    local_blocks: int = 0,
) -> torch.Tensor:
    """Pick K candidate blocks per (request, kv head).

    scores: `[bs, H_kv, M]` fp32 (entries at m >= num_candidates are ignored);
    num_candidates: `[bs]`. Forced sink/local blocks count inside K; the rest go by score,
    ties to the lower block index, NaN as -inf. A request with at most K candidates gets all
    of them. If more blocks are forced than K, sink blocks are kept first (lowest index first),
    then local blocks nearest the current block (see `forced_tier`).
    Returns `[bs, H_kv, K]` int32 logical block indices in ascending order, padded with -1.
    """
    bs, h_kv, m = scores.shape
    if k <= 0:
        return torch.full((bs, h_kv, 0), -1, dtype=torch.int32, device=scores.device)
    valid = torch.arange(m, device=scores.device)[None, :] < num_candidates[:, None]
    tier = forced_tier(num_candidates, m, sink_blocks, local_blocks)
    key = torch.nan_to_num(scores.float(), nan=float("-inf"))
    # Within the forced tiers scores do not matter: sinks tie (so the lowest index wins) and
    # local blocks rank by nearness to the current block (larger m first).
    block_idx = torch.arange(m, device=scores.device, dtype=key.dtype)
    key = torch.where((tier == 1)[:, None, :], block_idx, key)
    key = torch.where((tier == 2)[:, None, :], 0.0, key)
    # Stable descending sorts keep the lower index first among equal keys (the tie rule):
    # by key first, then by tier, so the tier dominates and the key orders within a tier.
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices
    tier_ranked = torch.gather(tier[:, None, :].expand(bs, h_kv, m), -1, order)
    order = torch.gather(order, -1, torch.sort(tier_ranked, dim=-1, descending=True, stable=True).indices)
    ranked_valid = torch.gather(valid[:, None, :].expand(bs, h_kv, m), -1, order)
    # Invalid blocks can sit anywhere among -inf keys: push them behind every valid block.
    rank_key = (~ranked_valid).to(torch.int64) * m + torch.arange(m, device=scores.device)
    order = torch.gather(order, -1, torch.sort(rank_key, dim=-1, stable=True).indices)
    take = min(k, m)
    chosen = order[..., :take]
    n_take = num_candidates.clamp(max=k)[:, None, None]
    chosen = torch.where(torch.arange(take, device=scores.device) < n_take, chosen, m)
    chosen = torch.sort(chosen, dim=-1).values
    chosen = torch.where(chosen == m, -1, chosen).to(torch.int32)
    if take < k:
        pad = torch.full((bs, h_kv, k - take), -1, dtype=torch.int32, device=scores.device)
        chosen = torch.cat([chosen, pad], dim=-1)
    return chosen
