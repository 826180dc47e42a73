"""Gate query from the post-RoPE query, the plain statement (tests only): undo the model's RoPE exactly, project
each kv head's group of query heads, RMS-normalize, rotate with the gate's RoPE. Only torch and the RoPE statement
(`ops.rope`): nothing of the paths it checks."""

from __future__ import annotations

import torch

from sas_backend.ops.rope import apply_rope, invert_rope

NORM_EPS = 1e-6  # the gate's RMSNorm epsilon, as trained


def gate_query_post_rope(
    q_post: torch.Tensor, model_cos_sin: torch.Tensor, w_q: torch.Tensor, q_norm: torch.Tensor,
    gate_cos_sin: torch.Tensor,
) -> torch.Tensor:
    """Gate query from the query AFTER the model's RoPE (the reference for the fused kernel).

    q_post: `[N, H_q, D]`; model_cos_sin: `[N, D]` the model's table rows at each token's
    position (may carry a magnitude such as YaRN's mscale); w_q: `[H_kv, G, D, Dg]`;
    q_norm: `[Dg]`; gate_cos_sin: `[N, Dg]`. Returns `[N, H_kv, Dg]` fp32, i.e.
    `gate_query(q_pre, ...)` with q_pre recovered by the exact inverse of the model's rotation.
    """
    h_kv, g, d, dg = w_q.shape
    q_pre = invert_rope(q_post, model_cos_sin).view(q_post.shape[0], h_kv, g, d)
    proj = torch.einsum("nhgd,hgde->nhe", q_pre, w_q.float())
    normed = proj * torch.rsqrt(proj.pow(2).mean(dim=-1, keepdim=True) + NORM_EPS) * q_norm.float()
    return apply_rope(normed, gate_cos_sin)
