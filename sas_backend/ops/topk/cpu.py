"""Top-K block selection, the fast torch path for CPU: one `topk` over unique int64 keys.

Same output as the reference `select_blocks` (the oracle in the tests), without its three stable
sorts. Each candidate gets one int64 key whose order is exactly the reference's ranking:

    tier (2 sink, 1 local, 0 by score) | order-preserving bits of the score | (M - 1 - m)

so keys are unique (ties go to the lower block index) and `torch.topk` needs no stable order.
Sink blocks carry score bits 0 (lowest index wins), local blocks carry m (nearest first), NaN
counts as -inf and -0.0 as +0.0, as in the reference. Fixed shapes, no host sync: capturable.
"""

from __future__ import annotations

import torch

from sas_backend.ops.topk.naive import forced_tier

_INDEX_BITS = 20  # blocks per request < 2**20 (64M tokens at b = 64)


def order_preserving_bits(scores: torch.Tensor) -> torch.Tensor:
    """fp32 scores `[...]` -> int64 in [0, 2**32) ordered like the floats (NaN -> -inf, -0 -> +0)."""
    x = torch.nan_to_num(scores.float(), nan=float("-inf")) + 0.0  # -0.0 + 0.0 == +0.0
    bits = x.view(torch.int32).to(torch.int64)
    # Negative floats order backwards as integers: flip their magnitude bits.
    bits = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return bits + 2**31


def select_blocks_cpu(
    scores: torch.Tensor,
    num_candidates: torch.Tensor,
    k: int,
    sink_blocks: int = 0,
    local_blocks: int = 0,
) -> torch.Tensor:
    """Pick K candidate blocks per (request, kv head); same contract as `naive.select_blocks`.

    scores: `[bs, H_kv, M]` (entries at m >= num_candidates[r] are ignored); num_candidates `[bs]`.
    Returns `[bs, H_kv, K]` int32 logical block indices in ascending order, padded with -1.
    """
    bs, h_kv, m = scores.shape
    if k <= 0:
        return torch.full((bs, h_kv, 0), -1, dtype=torch.int32, device=scores.device)
    if m >= 2**_INDEX_BITS:
        raise ValueError(f"select_blocks_cpu supports fewer than {2**_INDEX_BITS} blocks, got {m}")
    idx = torch.arange(m, device=scores.device)
    key = (order_preserving_bits(scores) << _INDEX_BITS) | (m - 1 - idx)
    if sink_blocks or local_blocks:
        tier = forced_tier(num_candidates, m, sink_blocks, local_blocks)[:, None, :]  # [bs, 1, M]
        forced_value = torch.where(tier == 1, idx, 0)  # local: nearest first; sink: lowest index first
        forced_key = (tier << (32 + _INDEX_BITS)) | (forced_value << _INDEX_BITS) | (m - 1 - idx)
        key = torch.where(tier > 0, forced_key, key)
    valid = idx[None, :] < num_candidates[:, None]
    key = key.masked_fill(~valid[:, None, :], -1)  # below every candidate's key
    take = min(k, m)
    top = torch.topk(key, take, dim=-1, sorted=False)
    chosen = torch.where(top.values >= 0, top.indices, m)  # m sorts behind every real block
    chosen = torch.sort(chosen, dim=-1).values
    chosen = torch.where(chosen == m, -1, chosen).to(torch.int32)
    if take < k:
        pad = torch.full((bs, h_kv, k - take), -1, dtype=torch.int32, device=scores.device)
        chosen = torch.cat([chosen, pad], dim=-1)
    return chosen
