"""A narrower gate cut from a trained one: the init of a gate trained at another width.

A gate's Dg dims are Dg/2 rotary pairs in the rotate-half layout (dim i pairs with i + Dg/2 and turns at
theta^(-2i/Dg)). Keeping every r-th pair (r = Dg / dg) keeps pairs whose frequencies are exactly those a dg-wide gate
turns at, theta^(-2j/dg) for j < dg/2, so the cut gate's projections, norms and RoPE agree with what it was cut from
on the dims it keeps; only RMSNorm's mean is over fewer dims. Why: 4 sub-block summaries of a gate a quarter as
wide read one summary's bytes (docs/launch-budget.md), and a cut of the shipped gate starts that training nearer
its answer than a seeded init.
"""

from __future__ import annotations

import torch


def kept_dims(gate_dim: int, width: int) -> torch.Tensor:
    """`[width]` indices of the dims a `width`-wide cut of a `gate_dim`-wide gate keeps (every r-th rotary pair,
    both halves). ValueError unless width is even and divides gate_dim."""
    if width < 2 or width % 2 or gate_dim % width:
        raise ValueError(f"a gate {gate_dim} wide can be cut to an even width dividing it, not {width}")
    r = gate_dim // width
    first = torch.arange(width // 2) * r
    return torch.cat([first, first + gate_dim // 2])


def narrow_gate_tensors(tensors: dict, width: int) -> dict:
    """`{layer: {name: tensor}}` of a gate -> the same cut to `width` dims (`kept_dims`), new tensors.

    attngate_linear_q `[H_kv, G, D, Dg]` and attngate_linear_k `[H_kv, 3D, Dg]` keep those output columns,
    attngate_qnorm / attngate_knorm `[Dg]` those entries.
    """
    out = {}
    for layer, t in tensors.items():
        idx = kept_dims(int(t["attngate_qnorm.weight"].shape[-1]), width)
        out[layer] = {name: w.index_select(-1, idx.to(w.device)).contiguous() for name, w in t.items()}
    return out
