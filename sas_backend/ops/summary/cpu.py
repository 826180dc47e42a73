"""Decode-time summary update without a host decision: every request writes, most into page 0.

The reference `summary_update_decode` asks the host which requests completed a block; under a
CUDA graph (and its CPU contract test) that decision must stay on the device. Here every request
summarizes its last complete block and writes it to its page if the newest token completed it,
otherwise to page 0, SGLang's padding page, which no request ever owns.
"""

from __future__ import annotations

import torch

from sas_backend.ops.summary.naive import summarize_pages


def completed_blocks(
    block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per request, its last complete block and whether this step's token completed it.

    block_table: `[bs, >= cur + 1]`; seq_lens: `[bs]`. Returns (done `[bs]` bool, pages `[bs]`
    int64 physical page of block seq_len // b - 1 (block 0's page for a request with none),
    starts `[bs]` its first position). Fixed shapes, no host sync: every request gets a row.
    """
    lens = seq_lens.long()
    done = (lens > 0) & (lens % block_size == 0)
    block = (torch.div(lens, block_size, rounding_mode="floor") - 1).clamp_min(0)
    first = torch.gather(block_table.long(), 1, block[:, None]).squeeze(1)
    return done, torch.div(first, block_size, rounding_mode="floor"), block * block_size


def summary_update_decode_masked(
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
    """Same effect on every page a request owns as `summary_update_decode`; fixed shapes.

    Inputs as `naive.summary_update_decode` (block_table `[bs, >= cur + 1]`).
    Returns summaries_out `[num_pages, H_kv, Dg]`.
    """
    done, pages, starts = completed_blocks(block_table, seq_lens, block_size)
    summ = summarize_pages(k_buffer, pages, starts, model_cos_sin, gate_cos_sin, w_k, k_norm, block_size)
    summaries_out.index_copy_(0, torch.where(done, pages, 0), summ.to(summaries_out.dtype))
    return summaries_out
