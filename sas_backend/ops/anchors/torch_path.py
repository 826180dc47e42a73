"""Prompt anchors, the plain statement (torch on every device; fixed shapes where a decode step uses them).

At the end of a request's prompt, the blocks its last token attends most (per kv head: the dense softmax
summed over each block's keys, max over the group's query heads, as the oracle ranks) are its anchors; every
decode step of the request then forces them into its selection, right after the sink and local blocks. The
last prompt token is the one that wrote the answer's first token, so in a question over a long context its
attention points at where the answer lies, which a selector trained on short rows may not rank.
"""

from __future__ import annotations

import torch


def block_mass(logits: torch.Tensor, positions: torch.Tensor, block_size: int, width: int) -> torch.Tensor:
    """Attention mass of each block `[P, H_kv, width]`: the dense causal softmax of `logits` `[H_kv, G, P, T]`
    (query p at position positions[p] sees keys <= it) summed over each complete block's keys, max over the G
    query heads of a kv head; blocks past T // b are 0. The oracle's ranking (`hf.sparse_eval.oracle_scores`)."""
    h_kv, g, n_p, t = logits.shape
    causal = torch.arange(t, device=logits.device)[None, :] <= positions[:, None]  # [P, T]
    probs = torch.softmax(logits.float().masked_fill(~causal, float("-inf")), dim=-1)
    n_blocks = min(width, t // block_size)
    mass = torch.zeros(h_kv, g, n_p, width, device=logits.device)
    mass[..., :n_blocks] = probs[..., : n_blocks * block_size].unflatten(-1, (n_blocks, block_size)).sum(-1)
    return mass.amax(dim=1).transpose(0, 1)


def last_query_block_mass(q: torch.Tensor, k: torch.Tensor, scale: float, block_size: int) -> torch.Tensor:
    """Block attention mass of one query: `[H_kv, T // b]` fp32 (`block_mass` of that query).

    q: `[H_q, D]` the query (after RoPE); k: `[T, H_kv, D]` every key it sees, its own last (after RoPE);
    scale: the softmax scale.
    """
    h_q, d = q.shape
    t, h_kv, _ = k.shape
    logits = torch.einsum("hgd,thd->hgt", q.float().view(h_kv, h_q // h_kv, d), k.float())[:, :, None] * scale
    return block_mass(logits, torch.tensor([t - 1], device=q.device), block_size, t // block_size)[0]


def top_anchors(mass: torch.Tensor, num_candidates: int, count: int) -> torch.Tensor:
    """The `count` candidate blocks (index < num_candidates) of highest mass per kv head: `[H_kv, count]`
    int32, highest first, ties to the lower index, -1 padded when there are fewer candidates.

    mass: `[H_kv, NB]` (`last_query_block_mass`, or a sum of several queries' masses).
    """
    h_kv = mass.shape[0]
    out = torch.full((h_kv, count), -1, dtype=torch.int32, device=mass.device)
    take = max(0, min(count, num_candidates, mass.shape[1]))
    if take:
        order = torch.sort(mass[:, :num_candidates], dim=-1, descending=True, stable=True).indices
        out[:, :take] = order[:, :take].to(torch.int32)
    return out


def force_anchors(scores: torch.Tensor, anchors: torch.Tensor, num_candidates: torch.Tensor) -> torch.Tensor:
    """`scores` `[bs, H_kv, M]` with each row's anchored blocks `[bs, H_kv, R]` (-1 = none) raised to +inf where
    they are candidates (index < num_candidates `[bs]`): a pick takes them right after its forced blocks (whose
    keys rank above +inf), before every ranked block. Fixed shapes, no host sync: CUDA-graph capturable.
    Returns a new tensor.
    """
    bs, h_kv, m = scores.shape
    hit = torch.zeros(bs, h_kv, m + 1, dtype=torch.bool, device=scores.device)
    idx = anchors.long()
    hit.scatter_(-1, torch.where((idx >= 0) & (idx < m), idx, m), True)
    cand = torch.arange(m, device=scores.device)[None, :] < num_candidates.long()[:, None]  # [bs, M]
    return scores.masked_fill(hit[..., :m] & cand[:, None, :], float("inf"))
