"""The exact second level, the torch path (off CUDA, and the evaluation): batched gathers, fixed shapes."""

from __future__ import annotations

from typing import Optional

import torch

from sas_backend.ops.anchors.torch_path import force_anchors
from sas_backend.ops.key_codes import decode_pages
from sas_backend.ops.sparse_decode.torch_path import padded_token_rows
from sas_backend.ops.topk.torch_path import blocks_at, select_among, select_places


def block_logsumexp(q: torch.Tensor, k_buffer: torch.Tensor, first: torch.Tensor, block_table: torch.Tensor,
                    block_size: int, scale: float, k_scale: float = 1.0, key_codes=None) -> torch.Tensor:
    """`[bs, H_kv, G, C]` fp32: per query head of each kv group, the log-sum-exp of its logits over each
    first-level block's tokens (-inf at padding). Arguments as `exact_block_scores`."""
    bs, h_q, d = q.shape
    h_kv, c = first.shape[1], first.shape[2]
    g = h_q // h_kv
    valid = first >= 0
    starts = torch.gather(block_table.long(), 1, first.clamp_min(0).long().reshape(bs, h_kv * c)).view(bs, h_kv, c)
    if key_codes is not None:  # the pages' 4-bit codes (`ops.key_codes`: they hold K itself, k_scale applied)
        heads = torch.arange(h_kv, device=q.device)[None, :, None]
        keys = decode_pages(*key_codes, torch.div(starts, block_size, rounding_mode="floor"), block_size, heads)
        k_scale = 1.0
    else:
        # one index_select of the (slot, kv head) rows: a third of the time of k_buffer[slots, heads] on CPU
        slots = starts[..., None] + torch.arange(block_size, device=q.device)  # [bs, H_kv, C, b]
        rows = slots * h_kv + torch.arange(h_kv, device=q.device)[None, :, None, None]
        keys = torch.index_select(k_buffer.reshape(-1, d), 0, rows.reshape(-1)).view(bs, h_kv, c, block_size, d)
    keys = keys.float().reshape(bs * h_kv, c * block_size, d)
    logits = torch.bmm(q.float().reshape(bs * h_kv, g, d), keys.transpose(1, 2)) * (scale * k_scale)
    lse = torch.logsumexp(logits.view(bs, h_kv, g, c, block_size), dim=-1)
    return lse.masked_fill(~valid[:, :, None, :], float("-inf"))


def exact_block_scores(q: torch.Tensor, k_buffer: torch.Tensor, first: torch.Tensor, block_table: torch.Tensor,
                       block_size: int, scale: float, k_scale: float = 1.0, key_codes=None) -> torch.Tensor:
    """`[bs, H_kv, C]` fp32: each first-level block's log attention mass among the row's first-level blocks, max
    over the kv group's query heads (-inf at padding). q `[bs, H_q, D]` post-RoPE; k_buffer `[slots, H_kv, D]`;
    first `[bs, H_kv, C]` int32 blocks (-1 padded); block_table `[bs, >= M]` slot of each block's first token;
    key_codes: optional (packed, scales) of `ops.key_codes`, read in place of k_buffer (page = slot // b)."""
    return log_masses(block_logsumexp(q, k_buffer, first, block_table, block_size, scale, k_scale, key_codes))


def log_masses(lse: torch.Tensor) -> torch.Tensor:
    """`[bs, H_kv, C]`: the blocks' log-masses among themselves, max over the group, from their per-head
    log-sum-exps `[bs, H_kv, G, C]` (-inf at padding; a row with no blocks stays all -inf)."""
    total = torch.logsumexp(lse, dim=-1, keepdim=True)
    total = torch.where(torch.isfinite(total), total, torch.zeros_like(total))  # a row with no blocks: all -inf
    return (lse - total).amax(dim=2)


def raise_anchors(scores: torch.Tensor, first: torch.Tensor, anchors: Optional[torch.Tensor],
                  num_candidates: torch.Tensor, max_blocks: int) -> torch.Tensor:
    """scores `[bs, H_kv, C]` with the anchored candidates (the first level forced every anchor in) raised to +inf
    by `force_anchors`' rule; anchors `[bs, H_kv, R]` this batch's rows, or None."""
    if anchors is None:
        return scores
    bs, h_kv, _ = first.shape
    raised = force_anchors(torch.zeros(bs, h_kv, max_blocks, device=scores.device), anchors, num_candidates)
    hit = torch.gather(raised, -1, first.clamp_min(0).long()).isinf() & (first >= 0)
    return scores.masked_fill(hit, float("inf"))


def rerank_blocks_torch(q, k_buffer, first, block_table, num_candidates, k: int, max_blocks: int, scale: float,
                        block_size: int, sink_blocks: int = 0, local_blocks: int = 0,
                        anchors: Optional[torch.Tensor] = None, k_scale: float = 1.0, key_codes=None) -> torch.Tensor:
    """`ops.rerank.rerank_blocks` (same arguments, anchors `[bs, H_kv, R]` already this batch's rows): the exact
    scores of the first level's blocks, anchors among them raised to +inf, `select_blocks`' rule among those blocks
    (`ops.topk.torch_path.select_among`: the row's other blocks hold nothing to rank)."""
    scores = exact_block_scores(q, k_buffer, first, block_table, block_size, scale, k_scale, key_codes)
    scores = raise_anchors(scores, first, anchors, num_candidates, max_blocks)
    return select_among(scores, first, num_candidates, k, max_blocks, sink_blocks, local_blocks)


def rerank_attend_torch(q, k_buffer, v_buffer, first, block_table, seq_lens, num_candidates, k: int,
                        max_blocks: int, scale: float, block_size: int, sink_blocks: int = 0, local_blocks: int = 0,
                        anchors: Optional[torch.Tensor] = None, k_scale: float = 1.0,
                        v_scale: float = 1.0) -> "tuple[torch.Tensor, torch.Tensor]":
    """`ops.rerank.rerank_attend` (same arguments, anchors already this batch's rows): the candidates' and the
    current block's keys gathered once, their logits rank the candidates (`rerank_blocks_torch`'s rule) and, masked
    to the K kept plus the current block, are the attention's own (`sparse_decode`'s sum over those tokens)."""
    bs, h_q, d = q.shape
    h_kv, c = first.shape[1], first.shape[2]
    g, dv = h_q // h_kv, v_buffer.shape[-1]
    # rows of the C candidates (-1 padding read as block 0, masked), then the current block up to the newest token
    rows, valid = padded_token_rows(first, block_table, seq_lens, h_kv, block_size)  # [bs, H_kv, (C + 1) * b]
    keys = torch.index_select(k_buffer.reshape(-1, d), 0, rows.reshape(-1)).float()
    logits = torch.bmm(q.float().reshape(bs * h_kv, g, d), keys.view(bs * h_kv, -1, d).transpose(1, 2))
    logits = logits.mul_(scale * k_scale).view(bs, h_kv, g, c + 1, block_size)
    lse = torch.logsumexp(logits[..., :c, :], dim=-1).masked_fill(~(first >= 0)[:, :, None, :], float("-inf"))
    scores = raise_anchors(log_masses(lse), first, anchors, num_candidates, max_blocks)
    places, kept = select_places(scores, first, num_candidates, k, max_blocks, sink_blocks, local_blocks)
    # the attention's blocks: the kept places, then the current block (place C); only their values are read
    current = torch.full((bs, h_kv, 1), c, dtype=places.dtype, device=q.device)
    places = torch.cat([places, current], dim=-1)  # [bs, H_kv, T + 1]
    at = places[..., None].expand(-1, -1, -1, block_size)
    attend = torch.gather(valid.view(bs, h_kv, c + 1, block_size), 2, at)
    attend &= torch.cat([kept, current >= 0], dim=-1)[..., None]
    picked = torch.gather(logits, 3, at[:, :, None].expand(-1, -1, g, -1, -1))  # [bs, H_kv, G, T + 1, b]
    probs = torch.softmax(picked.masked_fill(~attend[:, :, None], float("-inf")).view(bs * h_kv, g, -1), dim=-1)
    value_rows = torch.gather(rows.view(bs, h_kv, c + 1, block_size), 2, at).reshape(-1)
    values = torch.index_select(v_buffer.reshape(-1, dv), 0, value_rows).float()
    out = torch.bmm(probs, values.view(bs * h_kv, -1, dv))
    if v_scale != 1.0:
        out = out * v_scale
    return out.view(bs, h_q, dv).to(q.dtype), blocks_at(first, places[..., :-1], kept, k, max_blocks)
