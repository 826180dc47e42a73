"""KV index building (plain torch): one row per (request, kv head) over the selected blocks.

The KV cache `[slots, H_kv, D]` is viewed as `[slots * H_kv, 1, D]`, so token `slot` of kv head
`h` is row `slot * H_kv + h`. Each (request r, kv head h) row lists its selected blocks in
ascending order, then the current block up to the newest token.
"""

from __future__ import annotations

import torch

from sas_backend.ops.score import candidate_counts


def row_lengths(seq_lens: torch.Tensor, k: int, block_size: int) -> torch.Tensor:
    """Tokens attended per request `[bs]`: min(K, candidates) whole blocks + the current block."""
    n_cand = candidate_counts(seq_lens, block_size)
    return n_cand.clamp(max=k) * block_size + (seq_lens - n_cand * block_size)


def row_capacity(k: int, block_size: int) -> int:
    """Most tokens one (request, kv head) row can hold: K whole blocks + the current block."""
    return (k + 1) * block_size


def kv_indptr_for(seq_lens: torch.Tensor, k: int, block_size: int, num_kv_heads: int) -> torch.Tensor:
    """`[bs * H_kv + 1]` int32 row offsets, rows ordered (request, kv head)."""
    lens = row_lengths(seq_lens, k, block_size).repeat_interleave(num_kv_heads)
    indptr = torch.zeros(lens.numel() + 1, dtype=torch.int32, device=seq_lens.device)
    indptr[1:] = torch.cumsum(lens, 0)
    return indptr


def build_kv_indices(
    selected: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int, kv_indptr: torch.Tensor,
    kv_indices_out: torch.Tensor,
) -> torch.Tensor:
    """Fill the token rows of every (request, kv head) into `kv_indices_out`.

    selected: `[bs, H_kv, K]` int32 ascending, -1 padded (from `select_blocks`); block_table:
    `[bs, >= cur + 1]` KV slot of each logical block's first token (a page is one block, so token
    o of block m sits at slot block_table[r, m] + o); seq_lens: `[bs]`; kv_indptr:
    `[bs*H_kv + 1]` from `kv_indptr_for(seq_lens, K, b, H_kv)`; kv_indices_out: int32 with at
    least kv_indptr[-1] entries (the rest is untouched). Row (r, h) gets its selected blocks
    (all b tokens each) in order, then the current block up to the newest token, as
    index = slot * H_kv + h. Returns kv_indices_out.
    """
    bs, h_kv, k = selected.shape
    offs = torch.arange(block_size, device=selected.device)
    heads = torch.arange(h_kv, device=selected.device)[:, None]
    for r in range(bs):
        first = block_table[r].long()
        n = int(seq_lens[r])
        cur = max(n - 1, 0) // block_size  # n = 0 (an empty row) must not wrap to block -1
        # Every kv head of a request selects min(K, candidates) blocks: one [H_kv, L] gather.
        blocks = selected[r, :, : min(k, cur)].long()  # [H_kv, n_sel]
        slots = (first[blocks][..., None] + offs).reshape(h_kv, -1)
        tail = (first[cur] + torch.arange(n - cur * block_size, device=offs.device)).expand(h_kv, -1)
        rows = torch.cat([slots, tail], dim=1) * h_kv + heads  # [H_kv, L]
        lo = int(kv_indptr[r * h_kv])
        kv_indices_out[lo : lo + rows.numel()] = rows.reshape(-1).to(torch.int32)
    return kv_indices_out
