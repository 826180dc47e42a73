"""Block scores: ONE entry point, the Triton kernel on CUDA, plain torch elsewhere.

`torch_path.score_blocks` is the plain statement and, being one gather and one batched contraction
already, the path off CUDA and the tests' reference; `triton.score_blocks_triton` is the kernel
(imported on first CUDA use only).
"""

from __future__ import annotations

from typing import Optional

import torch

from sas_backend.ops.score import torch_path
from sas_backend.ops.score.torch_path import candidate_counts


def score_blocks(
    gate_q: torch.Tensor,
    summaries: torch.Tensor,
    block_table: torch.Tensor,
    num_candidates: torch.Tensor,
    block_size: int,
    max_blocks: int,
    out: Optional[torch.Tensor] = None,
    sub_blocks: int = 1,
) -> torch.Tensor:
    """Scores `[bs, H_kv, max_blocks]` fp32 of every candidate block, `-inf` elsewhere.

    gate_q: `[bs, H_kv, Dg]`; summaries: `[num_pages, H_kv, n * Dg]` (row = physical page; n = sub_blocks run
    summaries of each block side by side, the block scoring its best run);
    block_table: `[bs, >= max_blocks]` KV slot of each logical block's first token;
    num_candidates: `[bs]`; out: optional `[bs, H_kv, max_blocks]` fp32 buffer (CUDA graphs).
    `s[r,h,m] = max_j gate_q[r,h] . summaries[block_table[r,m] // b, h, run j] / sqrt(Dg)` for m < num_candidates[r].
    """
    if gate_q.is_cuda:
        from sas_backend.ops.score.triton import score_blocks_triton

        return score_blocks_triton(gate_q, summaries, block_table, num_candidates, block_size, max_blocks, out=out,
                                   sub_blocks=sub_blocks)
    res = torch_path.score_blocks(gate_q, summaries, block_table, num_candidates, block_size, max_blocks, sub_blocks)
    return res if out is None else out.copy_(res)


__all__ = ["score_blocks", "candidate_counts"]
