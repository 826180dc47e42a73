"""The late blocks of a decode step, the plain statement (tests only): row by row, block by block, in Python."""

from __future__ import annotations

import torch


def late_blocks(block_table: torch.Tensor, num_candidates: torch.Tensor, seq_lens: torch.Tensor, valid: torch.Tensor,
                block_size: int) -> "tuple[list, torch.Tensor]":
    """([(page, first position)] of the late blocks, row-major, a page two rows share once per row; the marks after
    the step). A late block is a complete block before a row's current one (m < num_candidates[r]) whose page holds
    no valid summary; afterwards every complete block of the rows (m < seq_len // b) is marked. block_table
    `[bs, M + 1]` slots; num_candidates, seq_lens `[bs]`; valid `[num_pages]` bool (not modified)."""
    listed, after = [], valid.clone()
    for r in range(block_table.shape[0]):
        for m in range(int(num_candidates[r])):
            page = int(block_table[r, m]) // block_size
            if not bool(valid[page]):
                listed.append((page, m * block_size))
        for m in range(int(seq_lens[r]) // block_size):
            after[int(block_table[r, m]) // block_size] = True
    return listed, after
