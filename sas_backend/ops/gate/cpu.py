"""Gate query, the fast torch path for CPU: the chain in as few torch ops as torch allows.

Same contract and result as the reference `naive.gate_query_post_rope`: the two rotations are
each `x * c + roll(x, D/2) * s` (`ops.rope.rotate`), the projection one batched matmul over the
kv groups, the RMSNorm torch's fused `rms_norm`.
"""

from __future__ import annotations

import torch

from sas_backend.ops.gate.naive import GATE_NORM_EPS
from sas_backend.ops.rope import rotate, rotation_factors


def gate_query_cpu(
    q_post: torch.Tensor,
    model_cos_sin: torch.Tensor,
    w_q: torch.Tensor,
    q_norm: torch.Tensor,
    gate_cos_sin: torch.Tensor,
) -> torch.Tensor:
    """Gate query per kv head `[N, H_kv, Dg]` fp32 from the post-RoPE query.

    q_post: `[N, H_q, D]`; model_cos_sin: `[N, D]` the model's RoPE rows at each token's position;
    w_q: `[H_kv, G, D, Dg]`; q_norm: `[Dg]`; gate_cos_sin: `[N, Dg]` the gate's rows.
    """
    n = q_post.shape[0]
    h_kv, g, d, dg = w_q.shape
    q_pre = rotate(q_post, *rotation_factors(model_cos_sin, inverse=True))
    proj = torch.matmul(q_pre.view(n, h_kv, 1, g * d), w_q.float().view(h_kv, g * d, dg)).view(n, h_kv, dg)
    normed = torch.nn.functional.rms_norm(proj, (dg,), q_norm.float(), GATE_NORM_EPS)
    return rotate(normed, *rotation_factors(gate_cos_sin, inverse=False))
