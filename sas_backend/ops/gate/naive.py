"""Gate query from the post-RoPE query, the plain statement (tests only): undo the model's RoPE exactly, then
`torch_path.gate_query`."""

from __future__ import annotations

import torch

from sas_backend.ops.gate.torch_path import gate_query
from sas_backend.ops.rope import invert_rope

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
    return gate_query(invert_rope(q_post, model_cos_sin), w_q, q_norm, gate_cos_sin)
