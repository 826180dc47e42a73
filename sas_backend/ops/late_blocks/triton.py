"""The late blocks of a decode step (Triton): one launch, one program per row.

Each program walks its row's blocks in chunks: reads the chunk's validity marks, reserves room for its late blocks
with an atomic on the count (rows land in any order; a chunk's blocks stay in order), writes them, then marks the
chunk's complete blocks. A page two rows share (a radix prefix) is listed by every row that read its mark before
another row marked it, at least once: a program marks only pages it has read, so the first to read an unmarked
page lists it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 1024  # blocks a program reads at once (64K tokens)


@triton.jit
def _late_blocks_kernel(
    table_ptr, stride_t, ncand_ptr, lens_ptr, valid_ptr, pages_ptr, starts_ptr, count_ptr, flag_ptr, total_ptr,
    BLOCK_SIZE: tl.constexpr, CHUNK: tl.constexpr,
):
    r = tl.program_id(0)
    ncand = tl.load(ncand_ptr + r).to(tl.int64)
    ncomplete = tl.load(lens_ptr + r).to(tl.int64) // BLOCK_SIZE  # ncand, or ncand + 1: the block it completes
    upto = tl.maximum(ncand, ncomplete)
    for c0 in range(0, upto, CHUNK):
        m = c0 + tl.arange(0, CHUNK).to(tl.int64)
        inside = m < upto
        page = tl.load(table_ptr + r.to(tl.int64) * stride_t + m, mask=inside, other=0).to(tl.int64) // BLOCK_SIZE
        marked = tl.load(valid_ptr + page, mask=inside, other=1).to(tl.int32)
        late = (m < ncand) & (marked == 0)
        n = tl.sum(late.to(tl.int64), axis=0)
        if n > 0:
            base = tl.atomic_add(count_ptr, n)
            at = base + tl.cumsum(late.to(tl.int64), axis=0) - 1
            tl.store(pages_ptr + at, page, mask=late)
            tl.store(starts_ptr + at, m * BLOCK_SIZE, mask=late)
            tl.store(flag_ptr, 1)
            tl.atomic_add(total_ptr, n)
        tl.store(valid_ptr + page, tl.full([CHUNK], 1, tl.int1), mask=m < ncomplete)


def list_late_blocks_triton(block_table: torch.Tensor, num_candidates: torch.Tensor, seq_lens: torch.Tensor,
                            valid: torch.Tensor, block_size: int, pages_out: torch.Tensor, starts_out: torch.Tensor,
                            count_out: torch.Tensor, flag_out: torch.Tensor, total: torch.Tensor) -> None:
    """`ops.late_blocks.list_late_blocks` on CUDA (its docstring has the shapes); capturable: the count and flag
    are zeroed (two memsets), then one launch of bs programs."""
    if block_table.stride(-1) != 1:
        raise ValueError("block_table must be contiguous along its last axis")
    count_out.zero_()
    flag_out.zero_()
    bs = block_table.shape[0]
    if bs == 0:
        return
    _late_blocks_kernel[(bs,)](
        block_table, block_table.stride(0), num_candidates, seq_lens, valid, pages_out, starts_out, count_out,
        flag_out, total, BLOCK_SIZE=block_size, CHUNK=CHUNK, num_warps=4,
    )
