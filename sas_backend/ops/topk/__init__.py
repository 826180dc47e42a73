"""Top-K block selection: ONE entry point, the Triton kernel on CUDA, one torch `topk` elsewhere.

`naive.select_blocks` is the plain statement (three stable sorts) and the tests' oracle;
`torch_path.select_blocks_torch` the torch path; `triton.select_blocks_triton` the kernel (imported on
first CUDA use only).
"""

from __future__ import annotations

from typing import Optional

import torch

from sas_backend.ops.topk.torch_path import select_blocks_torch


def select_blocks(
    scores: torch.Tensor,
    num_candidates: torch.Tensor,
    k: int,
    sink_blocks: int = 0,
    local_blocks: int = 0,
    out: Optional[torch.Tensor] = None,
    workspace: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Pick K candidate blocks per (request, kv head).

    scores: `[bs, H_kv, M]` (entries at m >= num_candidates[r] are ignored); num_candidates:
    `[bs]`. Forced sink/local blocks count inside K; the rest go by score, ties to the lower
    block index, NaN as -inf; a request with at most K candidates gets all of them.
    out: optional `[bs, H_kv, K]` int32 buffer; workspace: optional int32 scratch for the
    kernel's split path (`triton.topk_workspace_numel`), ignored off CUDA.
    Returns `[bs, H_kv, K]` int32 logical block indices in ascending order, padded with -1.
    """
    if scores.is_cuda:
        from sas_backend.ops.topk.triton import select_blocks_triton

        return select_blocks_triton(scores, num_candidates, k, sink_blocks, local_blocks, out=out, workspace=workspace)
    res = select_blocks_torch(scores, num_candidates, k, sink_blocks, local_blocks)
    return res if out is None else out.copy_(res)


__all__ = ["select_blocks"]
