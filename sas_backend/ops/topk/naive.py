"""Top-K block selection, the plain statement (tests only): three stable sorts per (request, kv head)."""

from __future__ import annotations

import torch


def forced_tier(num_candidates: torch.Tensor, m: int, sink_blocks: int, local_blocks: int) -> torch.Tensor:
    """`[bs, m]` int64: 2 for a sink block (one of the first sink_blocks candidates), 1 for a local block (one of
    the local_blocks candidates right before the current block, not a sink), 0 for a block chosen by score and
    for non-candidates; stated per request."""
    tier = torch.zeros(num_candidates.shape[0], m, dtype=torch.int64, device=num_candidates.device)
    for r, n in enumerate(num_candidates.tolist()):
        for j in range(min(n, m)):
            tier[r, j] = 2 if j < sink_blocks else 1 if j >= n - local_blocks else 0
    return tier


def select_blocks(
    scores: torch.Tensor, num_candidates: torch.Tensor, k: int, sink_blocks: int = 0, local_blocks: int = 0,
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
