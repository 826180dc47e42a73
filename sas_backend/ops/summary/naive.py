"""Block summaries (plain torch): Kmaxminavg pooling, projection, RMSNorm, RoPE at block start."""

from __future__ import annotations

import torch

from sas_backend.ops.gate.naive import rms_norm
from sas_backend.ops.rope import apply_rope, invert_rope


def pool_block_keys(k_blocks_pre: torch.Tensor) -> torch.Tensor:
    """`[N, b, H_kv, D]` pre-RoPE keys -> `[N, H_kv, 3D]` fp32 = cat(max, min, mean) over tokens."""
    k = k_blocks_pre.float()
    return torch.cat([k.amax(dim=1), k.amin(dim=1), k.mean(dim=1)], dim=-1)


def summarize_blocks(
    k_blocks_pre: torch.Tensor, w_k: torch.Tensor, k_norm: torch.Tensor, block_cos_sin: torch.Tensor
) -> torch.Tensor:
    """Summaries of complete blocks.

    k_blocks_pre: `[N, b, H_kv, D]` keys after the model's k-norm, before RoPE.
    w_k: `[H_kv, 3D, Dg]`; k_norm: `[Dg]`; block_cos_sin: `[N, Dg]` at each block's first position.
    Returns `[N, H_kv, Dg]` fp32.
    """
    return summarize_pooled(pool_block_keys(k_blocks_pre), w_k, k_norm, block_cos_sin)


def summarize_pooled(
    pooled: torch.Tensor, w_k: torch.Tensor, k_norm: torch.Tensor, block_cos_sin: torch.Tensor
) -> torch.Tensor:
    """Summaries from already pooled keys (`pool_block_keys`): `[N, H_kv, 3D]` -> `[N, H_kv, Dg]` fp32.

    Lets training on cached features (`sas_backend.training.features`) keep 3D numbers per block
    instead of b * D. w_k, k_norm, block_cos_sin as in `summarize_blocks`.
    """
    proj = torch.bmm(pooled.float().transpose(0, 1), w_k.float()).transpose(0, 1)  # [N, H_kv, Dg]
    return apply_rope(rms_norm(proj, k_norm), block_cos_sin)


def summarize_pages(
    k_buffer: torch.Tensor,
    pages: torch.Tensor,
    block_starts: torch.Tensor,
    model_cos_sin: torch.Tensor,
    gate_cos_sin: torch.Tensor,
    w_k: torch.Tensor,
    k_norm: torch.Tensor,
    block_size: int,
) -> torch.Tensor:
    """Summaries of whole blocks read back from the paged KV cache.

    k_buffer: `[slots, H_kv, D]` post-RoPE keys (as SGLang stores them); the block in physical
    page p occupies slots `p*b .. p*b+b-1` in position order. pages, block_starts: `[N]` (the
    block's physical page and its first position). model_cos_sin: the model's own RoPE table
    `[max_pos, D]` (used to undo its RoPE); gate_cos_sin: the gate's table `[max_pos, Dg]`.
    Returns `[N, H_kv, Dg]` fp32.
    """
    offs = torch.arange(block_size, device=k_buffer.device)
    slots = pages.long()[:, None] * block_size + offs[None, :]  # [N, b]
    positions = block_starts.long()[:, None] + offs[None, :]  # [N, b]
    k_post = k_buffer[slots]  # [N, b, H_kv, D]
    k_pre = invert_rope(k_post, model_cos_sin[positions])
    return summarize_blocks(k_pre, w_k, k_norm, gate_cos_sin[block_starts.long()])


def summary_update_decode(
    k_buffer: torch.Tensor,
    summaries_out: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    model_cos_sin: torch.Tensor,
    gate_cos_sin: torch.Tensor,
    w_k: torch.Tensor,
    k_norm: torch.Tensor,
) -> torch.Tensor:
    """Summaries of the blocks completed by this decode step, written in place.

    block_table: `[bs, >= M + 1]` KV slot of the first token of each logical block (a page is one
    block); seq_lens: `[bs]`. A request whose newest token completes a block (seq_len % b == 0,
    seq_len > 0) gets block m = seq_len // b - 1 summarized (page = block_table[r, m] // b,
    start = m*b) into `summaries_out[page]` `[num_pages, H_kv, Dg]` (cast to its dtype). Other
    requests write nothing. k_buffer must already hold the new token's key. Other inputs as
    `summarize_pages`. Returns summaries_out. (Host-side selection: the reference, not capturable.)
    """
    lens = seq_lens.long()
    rows = ((lens > 0) & (lens % block_size == 0)).nonzero().flatten()
    if rows.numel() == 0:
        return summaries_out
    blocks = lens[rows] // block_size - 1
    pages = torch.div(block_table[rows, blocks].long(), block_size, rounding_mode="floor")
    summ = summarize_pages(k_buffer, pages, blocks * block_size, model_cos_sin, gate_cos_sin, w_k, k_norm, block_size)
    summaries_out[pages] = summ.to(summaries_out.dtype)
    return summaries_out
