"""The decode-time summary update, the plain statement (tests only): the host picks the requests whose newest
token completed a block, and each such block (or each run of it) is summarized: its keys read back from the paged
cache with the model's RoPE undone, pooled (max | min | mean over its tokens), projected, RMS-normalized and rotated
with the gate's RoPE at its first position. Only torch and the RoPE statement (`ops.rope`): nothing of the paths
it checks."""

from __future__ import annotations

import torch

from sas_backend.ops.rope import apply_rope, invert_rope

NORM_EPS = 1e-6  # the gate's RMSNorm epsilon, as trained


def summarize_run(k_buffer: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, model_cos_sin: torch.Tensor,
                  gate_cos_sin: torch.Tensor, w_k: torch.Tensor, k_norm: torch.Tensor) -> torch.Tensor:
    """`[N, H_kv, Dg]` fp32 summaries of N runs of tokens: slots, positions `[N, S]` (a run's KV slots and
    positions in order); k_buffer `[slots, H_kv, D]` fp32 post-RoPE keys; tables, w_k `[H_kv, 3D, Dg]` and
    k_norm `[Dg]` as `summary_update_decode`."""
    k_pre = invert_rope(k_buffer[slots], model_cos_sin[positions])  # [N, S, H_kv, D]
    pooled = torch.cat([k_pre.amax(dim=1), k_pre.amin(dim=1), k_pre.mean(dim=1)], dim=-1)  # [N, H_kv, 3D]
    proj = torch.einsum("nhc,hce->nhe", pooled, w_k.float())
    normed = proj * torch.rsqrt(proj.pow(2).mean(dim=-1, keepdim=True) + NORM_EPS) * k_norm.float()
    return apply_rope(normed, gate_cos_sin[positions[:, 0]])


def summary_update_decode(
    k_buffer: torch.Tensor, summaries_out: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
    block_size: int, model_cos_sin: torch.Tensor, gate_cos_sin: torch.Tensor, w_k: torch.Tensor, k_norm: torch.Tensor,
    sub_blocks: int = 1,
    k_scale: float = 1.0,
) -> torch.Tensor:
    """Summaries of the blocks completed by this decode step, written in place (of the keys as stored times
    k_scale: an fp8 cache holds K / k_scale).

    block_table: `[bs, >= M + 1]` KV slot of the first token of each logical block (a page is one
    block); seq_lens: `[bs]`. A request whose newest token completes a block (seq_len % b == 0,
    seq_len > 0) gets block m = seq_len // b - 1 summarized (page = block_table[r, m] // b,
    start = m*b) into `summaries_out[page]` `[num_pages, H_kv, n * Dg]` (cast to its dtype): with n =
    sub_blocks, run j (tokens j*S .. (j+1)*S - 1 of the block, S = b / n) summarized as a block of S tokens
    starting at position m*b + j*S, into columns j*Dg .. (j+1)*Dg - 1. Other requests write nothing. k_buffer
    `[slots, H_kv, D]` post-RoPE keys must already hold the new token's key; model_cos_sin `[max_pos, D]`,
    gate_cos_sin `[max_pos, Dg]` the tables; w_k `[H_kv, 3D, Dg]`, k_norm `[Dg]`. Returns summaries_out.
    (Host-side selection: the reference, not capturable.)
    """
    lens = seq_lens.long()
    rows = ((lens > 0) & (lens % block_size == 0)).nonzero().flatten()
    if rows.numel() == 0:
        return summaries_out
    blocks = lens[rows] // block_size - 1
    pages = torch.div(block_table[rows, blocks].long(), block_size, rounding_mode="floor")
    size = block_size // sub_blocks
    dg = summaries_out.shape[-1] // sub_blocks
    offs = torch.arange(size, device=k_buffer.device)
    keys = k_buffer.float() * k_scale
    for j in range(sub_blocks):  # run j of page p: slots p*b + j*S .. p*b + (j+1)*S - 1
        slots = (pages * block_size + j * size)[:, None] + offs[None, :]
        positions = (blocks * block_size + j * size)[:, None] + offs[None, :]
        summ = summarize_run(keys, slots, positions, model_cos_sin, gate_cos_sin, w_k, k_norm)
        summaries_out[pages, :, j * dg:(j + 1) * dg] = summ.to(summaries_out.dtype)
    return summaries_out
