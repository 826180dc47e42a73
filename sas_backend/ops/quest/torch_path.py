"""Quest's training-free block scores (plain torch): an upper bound of q.k over each block.

Per complete block and kv head the summary is the elementwise min and max of its b post-RoPE keys,
`[2D]` = cat(min, max). For a query q the bound `sum_d max(q_d * min_d, q_d * max_d)` is at least
q.k for every key of the block; a kv head scores a block by the largest bound over its G query
heads (they share one selection). Queries and keys are taken as the cache holds them (after the
model's RoPE), so nothing is undone.
"""

from __future__ import annotations

import torch


def key_bounds(k_buffer: torch.Tensor, pages: torch.Tensor, block_size: int, k_scale: float = 1.0) -> torch.Tensor:
    """`[N, H_kv, 2D]` fp32 cat(min, max) over the b keys of each physical page in `pages` `[N]`.

    k_buffer: `[slots, H_kv, D]` (page p holds slots p*b .. p*b+b-1; fp8: K / k_scale, the keys bounded are
    the stored numbers times k_scale).
    """
    offs = torch.arange(block_size, device=k_buffer.device)
    keys = k_buffer[pages.long()[:, None] * block_size + offs].float()  # [N, b, H_kv, D]
    if k_scale != 1.0:  # (an op more per update only for an fp8 cache with a scale)
        keys = keys * k_scale
    return torch.cat([keys.amin(dim=1), keys.amax(dim=1)], dim=-1)


def quest_scores(
    q_post: torch.Tensor,
    bounds: torch.Tensor,
    block_table: torch.Tensor,
    num_candidates: torch.Tensor,
    block_size: int,
    max_blocks: int,
) -> torch.Tensor:
    """Scores `[bs, H_kv, max_blocks]` fp32, `-inf` past each row's candidates.

    q_post: `[bs, H_q, D]` as the cache holds it (after RoPE); bounds: `[num_pages, H_kv, 2D]`
    from `key_bounds`; block_table: `[bs, >= max_blocks]` KV slot of each logical block's first
    token; num_candidates: `[bs]`. `s[r,h,m] = max_g sum_d max(q[r,h*G+g,d] * min[d], q * max[d])`.
    """
    bs, h_q, d = q_post.shape
    h_kv = bounds.shape[1]
    pages = torch.div(block_table[:, :max_blocks].long(), block_size, rounding_mode="floor")
    kmin, kmax = bounds[pages].float().split(d, dim=-1)  # [bs, M, H_kv, D] each
    q = q_post.float().view(bs, h_kv, h_q // h_kv, d)
    # max(q*lo, q*hi) = q*hi where q > 0, else q*lo: two contractions, no [.., M, D] product.
    bound = (torch.einsum("rhgd,rmhd->rhgm", q.clamp_min(0), kmax)
             + torch.einsum("rhgd,rmhd->rhgm", q.clamp_max(0), kmin))
    scores = bound.amax(dim=2)
    valid = torch.arange(max_blocks, device=q_post.device) < num_candidates[:, None]
    return scores.masked_fill(~valid[:, None, :], float("-inf"))
