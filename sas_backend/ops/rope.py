"""Rotary position embedding helpers shared by the serving ops, the gate and training.

Layout convention (SGLang's and transformers' "neox" style, used by Llama and Qwen):
a vector x of `rot_dim` dims is split in halves (x1, x2) and rotated as
`(x1*cos - x2*sin, x2*cos + x1*sin)`. A cos/sin table is `[max_pos, rot_dim]` with the
cos half first and the sin half second, exactly like SGLang's `RotaryEmbedding.cos_sin_cache`,
so the backend can use the served model's own table to undo its RoPE.
"""

from __future__ import annotations

import math
from typing import Optional

import torch


def rope_inv_freq(dim: int, theta: float, scaling: Optional[dict] = None) -> torch.Tensor:
    """Inverse frequencies `[dim // 2]` (fp32) for RoPE over `dim` dims.

    `scaling` follows HF's `rope_scaling`/`rope_parameters`: None or type "default" gives
    plain RoPE; "llama3" applies Llama-3.1's frequency remapping. Other types are refused
    (the gate must use the same rotary formula as the model it serves).
    """
    if dim % 2:
        raise ValueError(f"RoPE needs an even dimension, got {dim}")
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind in (None, "default"):
        return inv.float()
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_ctx = float(scaling["original_max_position_embeddings"])
        low_wavelen = old_ctx / low
        high_wavelen = old_ctx / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(is_mid, mid, scaled).float()
    raise ValueError(f"unsupported rope scaling type {kind!r} (supported: default, llama3)")


def rope_cos_sin_table(
    dim: int, max_pos: int, theta: float, scaling: Optional[dict] = None, device=None
) -> torch.Tensor:
    """The `[max_pos, dim]` fp32 table `cat(cos, sin)` for positions 0..max_pos-1."""
    inv = rope_inv_freq(dim, theta, scaling).to(device)
    t = torch.arange(max_pos, dtype=torch.float32, device=device)
    freqs = torch.outer(t, inv)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def _rotate(x: torch.Tensor, cos_sin: torch.Tensor, sign: float) -> torch.Tensor:
    half = cos_sin.shape[-1] // 2
    cos = cos_sin[..., :half].float()
    sin = cos_sin[..., half:].float() * sign
    while cos.dim() < x.dim():  # broadcast over head axes between position and dim
        cos = cos.unsqueeze(-2)
        sin = sin.unsqueeze(-2)
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def apply_rope(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """Rotate x `[..., H, dim]` (or `[..., dim]`) by `cos_sin` `[..., dim]` gathered at its positions.

    Returns fp32. `cos_sin` has the leading (token) axes of x and no head axis.
    """
    return _rotate(x, cos_sin, 1.0)


def invert_rope(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """Undo `apply_rope`: rotate by the negative angle (RoPE is a rotation). Returns fp32."""
    return _rotate(x, cos_sin, -1.0)
