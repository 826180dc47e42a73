"""KV index building (plain torch): one row per (request, kv head) over the selected blocks.

The KV cache `[slots, H_kv, D]` is viewed as `[slots * H_kv, 1, D]`, so token `slot` of kv head
`h` is row `slot * H_kv + h`. Each (request r, kv head h) row lists its selected blocks in
ascending order, then the current block up to the newest token.
"""

from __future__ import annotations

import torch

from sas_backend.ops.score.naive import candidate_counts


def row_lengths(seq_lens: torch.Tensor, k: int, block_size: int) -> torch.Tensor:
    """Tokens attended per request `[bs]`: min(K, candidates) whole blocks + the current block."""
    n_cand = candidate_counts(seq_lens, block_size)
    return n_cand.clamp(max=k) * block_size + (seq_lens - n_cand * block_size)


def kv_indptr_for(seq_lens: torch.Tensor, k: int, block_size: int, num_kv_heads: int) -> torch.Tensor:
    """`[bs * H_kv + 1]` int32 row offsets, rows ordered (request, kv head)."""
    lens = row_lengths(seq_lens, k, block_size).repeat_interleave(num_kv_heads)
    indptr = torch.zeros(lens.numel() + 1, dtype=torch.int32, device=seq_lens.device)
    indptr[1:] = torch.cumsum(lens, 0)
    return indptr


def build_kv_indices(
    selected: torch.Tensor,
    seq_lens: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rows of every (request, kv head).

    selected: `[bs, H_kv, K]` int32 ascending, -1 padded (from `select_blocks`); seq_lens,
    req_pool_indices: `[bs]`; req_to_token: `[max_reqs, max_context]`.
    Returns (kv_indptr `[bs*H_kv + 1]` int32, kv_indices `[kv_indptr[-1]]` int32) with
    index = slot * H_kv + h.
    """
    bs, h_kv, k = selected.shape
    indptr = kv_indptr_for(seq_lens, k, block_size, h_kv)
    parts = []
    offs = torch.arange(block_size, device=selected.device)
    heads = torch.arange(h_kv, device=selected.device)[:, None]
    for r in range(bs):
        row_slots = req_to_token[int(req_pool_indices[r])].long()
        n = int(seq_lens[r])
        cur = max(n - 1, 0) // block_size  # n = 0 (an empty row) must not wrap to block -1
        # Every kv head of a request selects min(K, candidates) blocks: one [H_kv, L] gather.
        blocks = selected[r, :, : min(k, cur)].long()  # [H_kv, n_sel]
        pos = (blocks[..., None] * block_size + offs).reshape(h_kv, -1)
        tail = torch.arange(cur * block_size, n, device=pos.device).expand(h_kv, -1)
        pos = torch.cat([pos, tail], dim=1)
        parts.append((row_slots[pos] * h_kv + heads).reshape(-1))
    indices = (
        torch.cat(parts).to(torch.int32)
        if parts
        else torch.zeros(0, dtype=torch.int32, device=selected.device)
    )
    return indptr, indices
