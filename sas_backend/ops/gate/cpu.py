"""Gate query, the fast torch path for CPU: the chain in as few torch ops as torch allows.

Same result as the reference `gate_query(invert_rope(q_post, model_cos_sin), ...)`. The two
rotations use per-step factors (`rotation_factors`, computed once per step and shared by every
layer), so each is `x * c + roll(x, D/2) * s`: three ops instead of a dozen; the projection is
one batched matmul and the RMSNorm torch's fused `rms_norm`.
"""

from __future__ import annotations

import torch

from sas_backend.ops.gate.naive import GATE_NORM_EPS


def rotation_factors(cos_sin: torch.Tensor, inverse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`[N, dim]` cos|sin rows -> (c, s) `[N, dim]` fp32 so that `x*c + roll(x, dim/2)*s` rotates x.

    Forward: `(x1 cos - x2 sin, x2 cos + x1 sin)`. Inverse: the exact inverse of that map, also
    when the table carries a magnitude factor (YaRN's mscale scales cos and sin alike): it divides
    by `cos^2 + sin^2`.
    """
    half = cos_sin.shape[-1] // 2
    cos, sin = cos_sin[..., :half].float(), cos_sin[..., half:].float()
    if inverse:
        norm = cos * cos + sin * sin
        cos, sin = cos / norm, -sin / norm
    return torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)


def rotate(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Rotate x `[N, ..., dim]` (fp32) by factors `[N, dim]` from `rotation_factors`."""
    shape = (c.shape[0],) + (1,) * (x.dim() - 2) + (c.shape[-1],)
    return torch.addcmul(x * c.view(shape), x.roll(c.shape[-1] // 2, dims=-1), s.view(shape))


def gate_query_cpu(
    q_post: torch.Tensor,
    model_inv: tuple[torch.Tensor, torch.Tensor],
    w_q_flat: torch.Tensor,
    q_norm: torch.Tensor,
    gate_rot: tuple[torch.Tensor, torch.Tensor],
) -> torch.Tensor:
    """Gate query per kv head from the post-RoPE query.

    q_post: `[N, H_q, D]`; model_inv: inverse factors `[N, D]` of the model's RoPE at each
    token's position; w_q_flat: `[H_kv, G*D, Dg]` fp32 (the checkpoint's `[H_kv, G, D, Dg]`
    reshaped); q_norm: `[Dg]`; gate_rot: forward factors `[N, Dg]` of the gate's RoPE.
    Returns `[N, H_kv, Dg]` fp32.
    """
    n = q_post.shape[0]
    h_kv, gd, dg = w_q_flat.shape
    q_pre = rotate(q_post.float(), *model_inv)
    proj = torch.matmul(q_pre.view(n, h_kv, 1, gd), w_q_flat).view(n, h_kv, dg)
    normed = torch.nn.functional.rms_norm(proj, (dg,), q_norm.float(), GATE_NORM_EPS)
    return rotate(normed, *gate_rot)
