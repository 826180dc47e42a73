"""Gate query, the torch path: the serving path off CUDA, and the statement the HF model's gate module runs.

- `gate_query(q_pre, ...)`: from the pre-RoPE query (the gate as trained: Qproj, RMSNorm, gate RoPE).
- `gate_query_torch(q_post, ...)`: the serving path's chain from the post-RoPE query in as few torch ops as torch
  allows (the two rotations each `x * c + roll(x, D/2) * s`, `ops.rope.rotate`; one batched matmul over the kv
  groups; torch's fused `rms_norm`); same result as `naive.gate_query_post_rope`.
"""

from __future__ import annotations

import torch

from sas_backend.ops.rope import apply_rope, rotate, rotation_factors

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


def gate_query_torch(
    q_post: torch.Tensor, model_cos_sin: torch.Tensor, w_q: torch.Tensor, q_norm: torch.Tensor,
    gate_cos_sin: torch.Tensor,
) -> torch.Tensor:
    """`ops.gate.gate_query_post_rope` off CUDA (its docstring has the shapes)."""
    n = q_post.shape[0]
    h_kv, g, d, dg = w_q.shape
    q_pre = rotate(q_post, *rotation_factors(model_cos_sin, inverse=True))
    proj = torch.matmul(q_pre.view(n, h_kv, 1, g * d), w_q.float().view(h_kv, g * d, dg)).view(n, h_kv, dg)
    normed = torch.nn.functional.rms_norm(proj, (dg,), q_norm.float(), GATE_NORM_EPS)
    return rotate(normed, *rotation_factors(gate_cos_sin, inverse=False))
