"""Gate query (plain torch): Qproj over the query heads of each kv group, RMSNorm, RoPE."""

from __future__ import annotations

import torch

from sas_backend.ops.rope import apply_rope, invert_rope

GATE_NORM_EPS = 1e-6


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = GATE_NORM_EPS) -> torch.Tensor:
    """RMSNorm over the last axis in fp32 (variance in fp32, as the gate was trained)."""
    xf = x.float()
    var = xf.pow(2).mean(dim=-1, keepdim=True)
    return xf * torch.rsqrt(var + eps) * weight.float()


def gate_query(
    q_pre: torch.Tensor, w_q: torch.Tensor, q_norm: torch.Tensor, gate_cos_sin: torch.Tensor
) -> torch.Tensor:
    """Gate query per kv head.

    q_pre: `[N, H_q, D]` query after the model's q-norm, before RoPE.
    w_q: `[H_kv, G, D, Dg]`; q_norm: `[Dg]`; gate_cos_sin: `[N, Dg]` (cos|sin at each position).
    Returns `[N, H_kv, Dg]` fp32: `rope(rmsnorm(sum_{g,i} q[h,g,i] * w_q[h,g,i,:]))`.
    """
    n = q_pre.shape[0]
    h_kv, g, d, dg = w_q.shape
    q = q_pre.float().reshape(n, h_kv, g * d).transpose(0, 1)  # [H_kv, N, G*D]
    proj = torch.bmm(q, w_q.float().reshape(h_kv, g * d, dg)).transpose(0, 1)  # [N, H_kv, Dg]
    return apply_rope(rms_norm(proj, q_norm), gate_cos_sin)


def gate_query_post_rope(
    q_post: torch.Tensor,
    model_cos_sin: torch.Tensor,
    w_q: torch.Tensor,
    q_norm: torch.Tensor,
    gate_cos_sin: torch.Tensor,
) -> torch.Tensor:
    """Gate query from the query AFTER the model's RoPE (the reference for the fused kernel).

    q_post: `[N, H_q, D]`; model_cos_sin: `[N, D]` the model's table rows at each token's
    position (may carry a magnitude such as YaRN's mscale); w_q: `[H_kv, G, D, Dg]`;
    q_norm: `[Dg]`; gate_cos_sin: `[N, Dg]`. Returns `[N, H_kv, Dg]` fp32, i.e.
    `gate_query(q_pre, ...)` with q_pre recovered by the exact inverse of the model's rotation.
    """
    return gate_query(invert_rope(q_post, model_cos_sin), w_q, q_norm, gate_cos_sin)
