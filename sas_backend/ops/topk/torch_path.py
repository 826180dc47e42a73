"""Top-K block selection, the torch path (off CUDA): one `topk` over unique int64 keys.

Same output as the reference `select_blocks` (the oracle in the tests), without its three stable
sorts. Each candidate gets one int64 key whose order is exactly the reference's ranking:

    tier (2 sink, 1 local, 0 by score) | order-preserving bits of the score | (M - 1 - m)

so keys are unique (ties go to the lower block index) and `torch.topk` needs no stable order.
Sink blocks carry score bits 0 (lowest index wins), local blocks carry m (nearest first), NaN
counts as -inf and -0.0 as +0.0, as in the reference. Fixed shapes, no host sync: capturable.
"""

from __future__ import annotations

from typing import Optional

import torch


def forced_mask(
    num_candidates: torch.Tensor, max_blocks: int, sink_blocks: int, local_blocks: int
) -> torch.Tensor:
    """`[bs, max_blocks]` bool: candidate blocks forced in (the first `sink_blocks` blocks and the
    `local_blocks` blocks right before the current one)."""
    return forced_tier(num_candidates, max_blocks, sink_blocks, local_blocks) > 0


def forced_tier(
    num_candidates: torch.Tensor, max_blocks: int, sink_blocks: int, local_blocks: int,
    blocks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """`[bs, max_blocks]` int64 priority tier: 2 = sink, 1 = local, 0 = chosen by score (or not a candidate).

    A block that is both sink and local is a sink. Tiers matter when more blocks are forced
    than K: sink blocks are kept first (lowest index first), then local blocks nearest the
    current block first, then blocks by score. Forced blocks outrank every score, +inf included.
    blocks: the tiers of these block indices instead (`[bs, ...]`, -1 = none: tier 0), shaped like them.
    Tensor arithmetic only (a Python scalar in torch.where costs a host copy per call on CPU, ~20 us).
    """
    if blocks is None:
        m = torch.arange(max_blocks, device=num_candidates.device)[None, :]
    else:
        m = blocks.long()
    n = num_candidates.long().view(-1, *([1] * (m.dim() - 1)))
    candidate = (m >= 0) & (m < n)
    sink = (m < sink_blocks) & candidate
    local = (m >= n - local_blocks) & candidate & ~sink
    return sink.long() * 2 + local.long()


_INDEX_BITS = 20  # blocks per request < 2**20 (64M tokens at b = 64)


def order_preserving_bits(scores: torch.Tensor) -> torch.Tensor:
    """fp32 scores `[...]` -> int64 in [0, 2**32) ordered like the floats (NaN -> -inf, -0 -> +0)."""
    x = torch.nan_to_num(scores.float(), nan=float("-inf")) + 0.0  # -0.0 + 0.0 == +0.0
    bits = x.view(torch.int32).to(torch.int64)
    # Negative floats order backwards as integers: flip their magnitude bits.
    bits = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return bits + 2**31


def select_blocks_torch(
    scores: torch.Tensor, num_candidates: torch.Tensor, k: int, sink_blocks: int = 0, local_blocks: int = 0,
) -> torch.Tensor:
    """`ops.topk.select_blocks` off CUDA (its docstring has the shapes and the rule)."""
    bs, h_kv, m = scores.shape
    blocks = torch.arange(m, device=scores.device).expand(bs, h_kv, m)
    return select_among(scores, blocks, num_candidates, k, m, sink_blocks, local_blocks)


def select_among(
    scores: torch.Tensor, blocks: torch.Tensor, num_candidates: torch.Tensor, k: int, max_blocks: int,
    sink_blocks: int = 0, local_blocks: int = 0,
) -> torch.Tensor:
    """`select_blocks`' rule over a candidate list instead of a whole row: scores `[bs, H_kv, C]` of the blocks
    `[bs, H_kv, C]` (ascending, -1 padded; every block < max_blocks); the blocks' forced tiers and tie order are
    those of their block indices, so the K kept are what `select_blocks` keeps over a row holding these scores at
    these blocks and nothing elsewhere. Returns `[bs, H_kv, K]` int32 ascending, -1 padded."""
    places, kept = select_places(scores, blocks, num_candidates, k, max_blocks, sink_blocks, local_blocks)
    return blocks_at(blocks, places, kept, k, max_blocks)


def select_places(
    scores: torch.Tensor, blocks: torch.Tensor, num_candidates: torch.Tensor, k: int, max_blocks: int,
    sink_blocks: int = 0, local_blocks: int = 0,
) -> "tuple[torch.Tensor, torch.Tensor]":
    """`select_among`'s choice as places in the candidate list: (places `[bs, H_kv, min(K, C)]` int64 indices
    into the C candidates, in no order; kept `[bs, H_kv, min(K, C)]` bool, False where a row had fewer
    candidates than K and the place holds none). Arguments as `select_among`."""
    c = scores.shape[-1]
    m = int(max_blocks)
    if m >= 2**_INDEX_BITS:
        raise ValueError(f"select_blocks_torch supports fewer than {2**_INDEX_BITS} blocks, got {m}")
    # Tensor-only where / masked_fill: a Python scalar in torch.where costs a host copy per call on CPU (~20 us).
    idx = blocks.long()
    n = num_candidates.long().view(-1, 1, 1)
    valid = (idx >= 0) & (idx < n)
    key = (order_preserving_bits(scores) << _INDEX_BITS) | (m - 1 - idx)
    if sink_blocks or local_blocks:
        tier = forced_tier(num_candidates, m, sink_blocks, local_blocks, blocks=idx)
        # tier 2 sink (lowest index first), 1 local (nearest first), then the score's bits
        forced_key = (tier << (32 + _INDEX_BITS)) | ((idx * (tier == 1)) << _INDEX_BITS) | (m - 1 - idx)
        key = torch.where(tier > 0, forced_key, key)
    key = key.masked_fill(~valid, -1)  # below every candidate's key
    top = torch.topk(key, min(max(k, 0), c), dim=-1, sorted=False)
    return top.indices, top.values >= 0


def blocks_at(blocks: torch.Tensor, places: torch.Tensor, kept: torch.Tensor, k: int, max_blocks: int) -> torch.Tensor:
    """The blocks `[bs, H_kv, C]` at `select_places`' places: `[bs, H_kv, K]` int32 ascending, -1 padded."""
    bs, h_kv, take = places.shape
    m = int(max_blocks)
    chosen = torch.gather(blocks.long(), -1, places).masked_fill(~kept, m)  # m sorts behind every real block
    chosen = torch.sort(chosen, dim=-1).values
    chosen = chosen.masked_fill(chosen == m, -1).to(torch.int32)
    if take < k:
        pad = torch.full((bs, h_kv, k - take), -1, dtype=torch.int32, device=blocks.device)
        chosen = torch.cat([chosen, pad], dim=-1)
    return chosen
