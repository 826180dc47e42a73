"""Rotary position embedding helpers shared by the serving ops, the gate and training.

Layout convention (SGLang's and transformers' "neox" style, used by Llama and Qwen):
a vector x of `rot_dim` dims is split in halves (x1, x2) and rotated as
`(x1*cos - x2*sin, x2*cos + x1*sin)`. A cos/sin table is `[max_pos, rot_dim]` with the
cos half first and the sin half second, exactly like SGLang's `RotaryEmbedding.cos_sin_cache`,
so the backend can use the served model's own table to undo its RoPE.

A table may carry a magnitude: YaRN multiplies cos and sin by its attention factor `mscale`
(SGLang and transformers both bake it into the table), so "applying" it scales as well as
rotates, and the exact inverse divides by `mscale^2 = cos^2 + sin^2` (`invert_rope`).

`rope_cos_sin_table` builds every RoPE table here; the gate's goes through
`sas_backend.geometry.gate_rope_table` (serving, training and the HF evaluation all call it), so a
gate is served with the very table it was trained with. It follows
SGLang's `get_rope` formulas (fp32 frequencies, fp32 angles) for the scalings Llama/Qwen use;
tests/test_model_support.py checks it against `get_rope` at the gate dim for each of them.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

# Scaling types the gate table can reproduce. SGLang's "dynamic" (a static NTK table) is left
# out on purpose: transformers' dynamic NTK rescales per sequence length, so training (HF) and
# serving (SGLang) would not share one formula.
SUPPORTED_ROPE_SCALINGS = ("default", "linear", "llama3", "yarn")


def rope_scaling_type(scaling: Optional[dict]) -> str:
    """The scaling kind of an HF `rope_scaling`/`rope_parameters` dict ("default" for None)."""
    if not scaling:
        return "default"
    return scaling.get("rope_type", scaling.get("type")) or "default"


def _yarn_correction_range(beta_fast, beta_slow, dim: int, theta: float, orig_ctx: float, truncate: bool):
    def dim_for(rotations):  # the dim index whose wavelength makes `rotations` turns over orig_ctx
        return dim * math.log(orig_ctx / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_for(beta_fast), dim_for(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def _yarn_mscale(factor: float, coeff: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * coeff * math.log(factor) + 1.0


def rope_attention_factor(scaling: Optional[dict]) -> float:
    """The magnitude a scaling bakes into cos/sin: YaRN's `mscale` (times `attn_factor`), else 1.

    SGLang's rule: `mscale(factor, mscale) / mscale(factor, mscale_all_dim)` when both keys are
    given, else `0.1 ln(factor) + 1`; times `attn_factor`. (transformers' optional
    `attention_factor` key is not read by SGLang, so it is not read here either.)
    """
    if rope_scaling_type(scaling) != "yarn":
        return 1.0
    factor = float(scaling.get("factor", 1.0))
    if scaling.get("mscale") is not None and scaling.get("mscale_all_dim") is not None:
        m = _yarn_mscale(factor, float(scaling["mscale"])) / _yarn_mscale(factor, float(scaling["mscale_all_dim"]))
    else:
        m = _yarn_mscale(factor)
    return float(m * float(scaling.get("attn_factor", 1.0)))


def rope_inv_freq(dim: int, theta: float, scaling: Optional[dict] = None) -> torch.Tensor:
    """Inverse frequencies `[dim // 2]` (fp32) for RoPE over `dim` dims.

    `scaling` follows HF's `rope_scaling`/`rope_parameters`: None or "default" gives plain RoPE;
    "linear" divides every frequency by `factor` (position interpolation); "llama3" applies
    Llama-3.1's frequency remapping; "yarn" blends interpolated and extrapolated frequencies
    over the correction range (YaRN). Other types are refused: the gate must use the same rotary
    formula as the model it serves. Computed in fp32 with SGLang's operations, so the table
    matches SGLang's `get_rope` for the same dim.
    """
    if dim % 2:
        raise ValueError(f"RoPE needs an even dimension, got {dim}")
    kind = rope_scaling_type(scaling)
    if kind not in SUPPORTED_ROPE_SCALINGS:
        raise ValueError(
            f"unsupported rope scaling type {kind!r} (supported: {', '.join(SUPPORTED_ROPE_SCALINGS)})"
        )
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    inv = 1.0 / pos_freqs
    if kind == "default":
        return inv
    factor = float(scaling.get("factor", 1.0))
    if kind == "linear":
        return inv / factor
    if kind == "llama3":
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_ctx = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        smooth = (old_ctx / wavelen - low) / (high - low) if low != high else torch.zeros_like(inv)
        mid = (1 - smooth) * inv / factor + smooth * inv
        return torch.where(
            wavelen < old_ctx / high, inv, torch.where(wavelen > old_ctx / low, inv / factor, mid)
        )
    # yarn
    orig_ctx = float(scaling.get("original_max_position_embeddings") or 0)
    if orig_ctx <= 0:
        raise ValueError("yarn rope scaling needs original_max_position_embeddings")
    lo, hi = _yarn_correction_range(
        scaling.get("beta_fast", 32), scaling.get("beta_slow", 1), dim, theta, orig_ctx,
        bool(scaling.get("truncate", True)),
    )
    if lo == hi:
        hi += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo), 0, 1)
    extrapolate = (1 - ramp) * float(scaling.get("extrapolation_factor", 1))
    return 1.0 / (factor * pos_freqs) * (1 - extrapolate) + inv * extrapolate


def rope_cos_sin_table(
    dim: int, max_pos: int, theta: float, scaling: Optional[dict] = None, device=None
) -> torch.Tensor:
    """The `[max_pos, dim]` fp32 table `cat(cos, sin) * attention_factor` for positions 0..max_pos-1.

    The single builder of gate RoPE tables (see the module docstring); `scaling` as in
    `rope_inv_freq`, the magnitude from `rope_attention_factor` (YaRN's mscale, else 1).
    """
    t = torch.arange(max_pos, dtype=torch.float32, device=device)
    if rope_scaling_type(scaling) == "linear":
        # SGLang interpolates the positions (t / factor), not the frequencies: same rounding.
        t = t / float(scaling.get("factor", 1.0))
        inv = rope_inv_freq(dim, theta, None).to(device)
    else:
        inv = rope_inv_freq(dim, theta, scaling).to(device)
    freqs = torch.outer(t, inv)
    table = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    m = rope_attention_factor(scaling)
    return table * m if m != 1.0 else table


def rotation_factors(cos_sin: torch.Tensor, inverse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`[..., dim]` cos|sin rows -> (c, s) `[..., dim]` fp32 with `rotate(x, c, s)` = the rotation.

    Forward: `(x1 cos - x2 sin, x2 cos + x1 sin)`. Inverse: the exact inverse of that map, also
    when the table carries a magnitude (YaRN's mscale) or was rounded to bf16: the inverse of
    [[c, -s], [s, c]] is [[c, s], [-s, c]] / (c^2 + s^2).
    """
    half = cos_sin.shape[-1] // 2
    cos, sin = cos_sin[..., :half].float(), cos_sin[..., half:].float()
    if inverse:
        norm = cos * cos + sin * sin
        cos, sin = cos / norm, -sin / norm
    return torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)


def rotate(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Rotate x `[N, ..., dim]` by factors `[N, dim]` from `rotation_factors`: `x*c + roll(x)*s`.

    Factors broadcast over the axes between the token axis and the last one (heads). Returns fp32.
    """
    shape = c.shape[:-1] + (1,) * (x.dim() - c.dim()) + c.shape[-1:]
    xf = x.float()
    return torch.addcmul(xf * c.view(shape), xf.roll(c.shape[-1] // 2, dims=-1), s.view(shape))


def apply_rope(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """Rotate x `[..., H, dim]` (or `[..., dim]`) by `cos_sin` `[..., dim]` gathered at its positions.

    Returns fp32. `cos_sin` has the leading (token) axes of x and no head axis. A table with a
    magnitude (YaRN) scales x by it too, as the model's own RoPE does.
    """
    return rotate(x, *rotation_factors(cos_sin, inverse=False))


def invert_rope(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """Exactly undo `apply_rope` with the same table: rotate by the negative angle and divide by
    the table's magnitude squared (1 for plain RoPE, mscale^2 for YaRN). Returns fp32."""
    return rotate(x, *rotation_factors(cos_sin, inverse=True))
