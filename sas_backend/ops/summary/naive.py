"""The decode-time summary update, the plain statement (tests only): the host picks the requests whose newest
token completed a block, and `torch_path.summarize_pages` summarizes those blocks."""

from __future__ import annotations

import torch

from sas_backend.ops.summary.torch_path import summarize_pages


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
    must already hold the new token's key. Other inputs as `summarize_pages`. Returns summaries_out.
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
    for j in range(sub_blocks):  # run j of page p occupies slots p*b + j*S .., i.e. "page" p*n + j of S slots
        summ = summarize_pages(k_buffer.float() * k_scale, pages * sub_blocks + j, blocks * block_size + j * size,
                               model_cos_sin, gate_cos_sin, w_k, k_norm, size)
        summaries_out[pages, :, j * dg:(j + 1) * dg] = summ.to(summaries_out.dtype)
    return summaries_out
