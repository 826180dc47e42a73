"""The late blocks of a decode step, the torch path: fixed shapes, no host sync (capturable), about 25 small
kernels over bs x M entries (the Triton kernel is one launch)."""

from __future__ import annotations

import torch


def list_late_blocks_torch(block_table: torch.Tensor, num_candidates: torch.Tensor, seq_lens: torch.Tensor,
                           valid: torch.Tensor, block_size: int, pages_out: torch.Tensor, starts_out: torch.Tensor,
                           count_out: torch.Tensor, flag_out: torch.Tensor, total: torch.Tensor) -> None:
    """`ops.late_blocks.list_late_blocks` in torch: the late blocks compacted in row-major order (the last entry of
    the buffers takes the scatter of every block that is not late), then the marks."""
    bs, width = block_table.shape
    dump = pages_out.shape[0] - 1
    m = torch.arange(width - 1, device=block_table.device)
    pages = torch.div(block_table[:, :-1], block_size, rounding_mode="floor")  # [bs, M]
    late = ((m[None, :] < num_candidates[:, None]) & ~valid[pages]).reshape(-1)
    at = torch.where(late, torch.cumsum(late, 0) - 1, dump)
    pages_out.scatter_(0, at, pages.reshape(-1))
    starts_out.scatter_(0, at, (m * block_size).expand(bs, -1).reshape(-1))
    count_out.copy_(late.sum().reshape(1))
    flag_out.copy_(count_out[0] > 0)
    total.add_(count_out)
    # Every complete block of the rows, marked (the other columns mark page 0, SGLang's padding page).
    cols = torch.arange(width, device=block_table.device)
    complete = cols[None, :] < torch.div(seq_lens.long(), block_size, rounding_mode="floor")[:, None]
    valid[torch.where(complete, torch.div(block_table, block_size, rounding_mode="floor"), 0).reshape(-1)] = True
