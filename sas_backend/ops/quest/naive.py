"""Quest's bounds and scores, the plain statement (tests only): loops over requests, kv heads and blocks."""

from __future__ import annotations

import torch


def key_bounds(k_buffer: torch.Tensor, pages: torch.Tensor, block_size: int) -> torch.Tensor:
    """`[N, H_kv, 2D]` fp32: per page in `pages` `[N]` and kv head, cat(min, max) over the page's b keys of
    k_buffer `[slots, H_kv, D]` (page p holds slots p*b .. p*b+b-1)."""
    out = []
    for p in pages.tolist():
        keys = k_buffer[p * block_size:(p + 1) * block_size].float()  # [b, H_kv, D]
        out.append(torch.cat([keys.min(dim=0).values, keys.max(dim=0).values], dim=-1))
    return torch.stack(out) if out else k_buffer.new_zeros(0, k_buffer.shape[1], 2 * k_buffer.shape[2]).float()


def quest_scores(q_post, bounds, block_table, num_candidates, block_size: int, max_blocks: int) -> torch.Tensor:
    """`[bs, H_kv, max_blocks]` fp32: for candidate block m of request r and kv head h, the largest over the
    head's G query heads of sum_d max(q_d * min_d, q_d * max_d) (at least q.k for every key of the block);
    -inf past the candidates. q_post `[bs, H_q, D]`, bounds `[num_pages, H_kv, 2D]`, block_table
    `[bs, >= max_blocks]` first slots, num_candidates `[bs]`."""
    bs, h_q, d = q_post.shape
    h_kv = bounds.shape[1]
    g = h_q // h_kv
    out = torch.full((bs, h_kv, max_blocks), float("-inf"))
    for r in range(bs):
        for m in range(min(int(num_candidates[r]), max_blocks)):
            page = int(block_table[r, m]) // block_size
            for h in range(h_kv):
                lo, hi = bounds[page, h, :d].float(), bounds[page, h, d:].float()
                best = max(float(torch.maximum(q_post[r, h * g + j].float() * lo,
                                               q_post[r, h * g + j].float() * hi).sum()) for j in range(g))
                out[r, h, m] = best
    return out.to(q_post.device)
