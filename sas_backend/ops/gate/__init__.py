"""The gate query from the post-RoPE query: ONE entry point for the serving path.

`gate_query_post_rope(q_post, model_cos_sin, w_q, q_norm, gate_cos_sin, out=None, workspace=None)` runs the
Triton kernels (`ops.gate.triton`, the split launch) for CUDA tensors and the batched torch path
(`ops.gate.torch_path`) otherwise; `ops.gate.naive` is the plain statement and the tests' oracle. The Triton
module is imported on first CUDA use only, so CPU callers never import Triton (and the test suite can set
TRITON_INTERPRET before any kernel module loads).
"""

from __future__ import annotations

from typing import Optional

import torch

from sas_backend.ops.gate.torch_path import GATE_NORM_EPS, gate_query_torch, rms_norm


def gate_query_post_rope(
    q_post: torch.Tensor,
    model_cos_sin: torch.Tensor,
    w_q: torch.Tensor,
    q_norm: torch.Tensor,
    gate_cos_sin: torch.Tensor,
    out: Optional[torch.Tensor] = None,
    workspace: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Gate query per kv head: `[N, H_kv, Dg]` fp32 (out if given).

    q_post: `[N, H_q, D]` query after the model's RoPE; model_cos_sin: `[N, D]` fp32 model table
    rows at each token's position; w_q: `[H_kv, G, D, Dg]`; q_norm: `[Dg]`; gate_cos_sin:
    `[N, Dg]` fp32; out: optional `[N, H_kv, Dg]` fp32 buffer (CUDA graphs: no allocation);
    workspace: optional fp32 scratch for the CUDA kernels' partials (`ops.gate.triton.gate_query_workspace_numel`;
    allocated per call when not given; unused on CPU).
    """
    if q_post.is_cuda:
        from sas_backend.ops.gate.triton import gate_query_triton

        return gate_query_triton(q_post, model_cos_sin, w_q, q_norm, gate_cos_sin, out=out, workspace=workspace)
    res = gate_query_torch(q_post, model_cos_sin, w_q, q_norm, gate_cos_sin)
    return res if out is None else out.copy_(res)


__all__ = ["GATE_NORM_EPS", "gate_query_post_rope", "rms_norm"]  # the norm: shared with the summaries (the key side)
