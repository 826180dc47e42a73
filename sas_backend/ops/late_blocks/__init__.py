"""The late blocks of a decode step (the summary pool's validity marks on the device): ONE entry point, the Triton
kernel on CUDA, torch elsewhere.

A late block is a complete block before a row's current one whose page holds no valid summary (`SummaryPool.valid`:
KV that landed without an extend through sas, e.g. a PD decode server's transferred pages). The decode step lists
them, marks its rows' complete blocks, and every sparse layer summarizes the listed ones before anything selects
(`ops.summary.summarize_listed`, `backend.decode_step.DecodeStep.repair`).

`naive.late_blocks` is the plain statement (tests); `torch_path.list_late_blocks_torch` the torch path (fixed
shapes: CPU's device-side form, `SAS_SUMMARY_MARKS=2`); `triton.list_late_blocks_triton` the kernel (imported on
first CUDA use only). The host-planned form CPU serves by default is `backend.page_marks.unmarked_blocks`.
"""

from __future__ import annotations

import torch

from sas_backend.ops.late_blocks.torch_path import list_late_blocks_torch


def list_late_blocks(block_table: torch.Tensor, num_candidates: torch.Tensor, seq_lens: torch.Tensor,
                     valid: torch.Tensor, block_size: int, pages_out: torch.Tensor, starts_out: torch.Tensor,
                     count_out: torch.Tensor, flag_out: torch.Tensor, total: torch.Tensor) -> None:
    """List the step's late blocks and mark its rows' complete blocks; fixed shapes, no host sync.

    block_table `[bs, M + 1]` int64 slot of each logical block's first token; num_candidates `[bs]` int64 complete
    blocks before each row's current one; seq_lens `[bs]` (complete blocks after the step: seq_len // b); valid
    `[num_pages]` bool, updated in place: every complete block of the rows marked. Written: pages_out[:n],
    starts_out[:n] int64 (physical page, first position; at least `bs * M + 1` entries; the order of the rows is
    unspecified on CUDA), count_out `[1]` int64 = n, flag_out 0-d bool = n > 0; total `[1]` int64 += n. Entries past
    n hold anything. A page two rows share is listed once or more (summarized to the same value each time).
    """
    if block_table.is_cuda:
        from sas_backend.ops.late_blocks.triton import list_late_blocks_triton

        return list_late_blocks_triton(block_table, num_candidates, seq_lens, valid, block_size, pages_out,
                                       starts_out, count_out, flag_out, total)
    return list_late_blocks_torch(block_table, num_candidates, seq_lens, valid, block_size, pages_out, starts_out,
                                  count_out, flag_out, total)


__all__ = ["list_late_blocks"]
