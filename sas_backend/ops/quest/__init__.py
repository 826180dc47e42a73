"""Quest block bounds and scores: torch on every device (fixed shapes, CUDA-graph capturable).

- `key_bounds(k_buffer, pages, block_size)`: the `[N, H_kv, 2D]` min|max summary of whole blocks.
- `update_key_bounds(...)`: at decode, the block each request's newest token completed.
- `quest_scores(...)`: the upper bound of q.k per candidate block (see `torch_path`).
"""

from __future__ import annotations

import torch

from sas_backend.ops.quest.torch_path import key_bounds, quest_scores
from sas_backend.ops.summary import completed_blocks


def update_key_bounds(
    k_buffer: torch.Tensor, bounds: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
    k_scale: float = 1.0,
) -> torch.Tensor:
    """Write the min|max summary of the block each request's newest token completed into `bounds`
    `[num_pages, H_kv, 2D]` (rows that completed none write page 0, SGLang's padding page)."""
    done, pages, _ = completed_blocks(block_table, seq_lens, block_size)
    bounds.index_copy_(0, torch.where(done, pages, 0),
                       key_bounds(k_buffer, pages, block_size, k_scale).to(bounds.dtype))
    return bounds


__all__ = ["key_bounds", "quest_scores", "update_key_bounds"]
