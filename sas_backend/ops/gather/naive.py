"""KV index rows over the selected blocks, the plain statement (tests only): one Python list per row."""

from __future__ import annotations

import torch


def kv_rows(selected: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int) -> list:
    """Per (request r, kv head h), in that order, the list of rows `slot * H_kv + h` it attends: each selected
    block's b tokens (ascending blocks, -1 skipped, at most the request's complete blocks before the current one),
    then the current block's tokens up to the newest. selected `[bs, H_kv, K]`, block_table `[bs, >= cur + 1]`
    first slots, seq_lens `[bs]`."""
    bs, h_kv, _ = selected.shape
    rows = []
    for r in range(bs):
        n = int(seq_lens[r])
        cur = max(n - 1, 0) // block_size
        for h in range(h_kv):
            row = []
            for m in sorted(b for b in selected[r, h].tolist() if 0 <= b < cur):
                row += [(int(block_table[r, m]) + o) * h_kv + h for o in range(block_size)]
            row += [(int(block_table[r, cur]) + o) * h_kv + h for o in range(n - cur * block_size)]
            rows.append(row)
    return rows


def build_kv_indices(selected, block_table, seq_lens, block_size: int) -> tuple:
    """(kv_indptr `[bs * H_kv + 1]` int32, kv_indices int32) of `kv_rows`, rows concatenated."""
    rows = kv_rows(selected, block_table, seq_lens, block_size)
    indptr = torch.tensor([0] + [len(r) for r in rows], dtype=torch.int64).cumsum(0).to(torch.int32)
    return indptr, torch.tensor([i for r in rows for i in r], dtype=torch.int32)
