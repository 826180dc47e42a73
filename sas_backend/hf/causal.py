"""Dense causal attention of the last queries over a cached prefix (evaluation and training), plain torch SDPA."""

from __future__ import annotations

import torch


def causal_sdpa(query, key, value, scale: float):
    """Causal attention of `[B, Hq, Lq, D]` queries that are the LAST Lq positions of the
    `[B, Hkv, L, D]` keys (Lq < L after a cached prefix), GQA allowed. Returns `[B, Hq, Lq, D]`."""
    h_q, l_q, l_k = query.shape[1], query.shape[2], key.shape[2]
    gqa = h_q != key.shape[1]
    if l_q == l_k:
        return torch.nn.functional.scaled_dot_product_attention(
            query, key, value, is_causal=True, scale=scale, enable_gqa=gqa)
    # SDPA's is_causal aligns top-left; these queries sit at the end of the keys
    allowed = (torch.arange(l_k, device=query.device)[None, :]
               <= torch.arange(l_k - l_q, l_k, device=query.device)[:, None])
    return torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=allowed, scale=scale, enable_gqa=gqa)
