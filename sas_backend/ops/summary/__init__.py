"""Block summaries: ONE entry point per use, the Triton kernel on CUDA, torch elsewhere.

- `summarize_pages(...)`: summaries of whole blocks read back from the paged KV cache (after an
  extend, and in the transformers evaluation).
- `update_summaries(...)`: the block each request's newest token completed, at decode; fixed
  shapes and no host sync on both paths (CUDA-graph capturable).

- `summarize_listed(...)`: the blocks a decode step listed as late (`ops.late_blocks.list_late_blocks`),
  before its selection; capturable on CUDA (the count stays on the device).

- `completed_blocks(...)`: per request, its last complete block and whether this step completed it.

`torch_path.py` is the torch path (capturable; also the pre-RoPE statement the HF model's gate module runs);
`triton.py` the fused kernels (imported on first CUDA use only, so CPU callers never import Triton);
`naive.py` the host-decided statement of the decode update, for tests only.
"""

from __future__ import annotations

import torch

from sas_backend.ops.summary import torch_path
from sas_backend.ops.summary.torch_path import completed_blocks, run_pages, runs_per_block


def summarize_pages(
    k_buffer: torch.Tensor,
    pages: torch.Tensor,
    block_starts: torch.Tensor,
    model_cos_sin: torch.Tensor,
    gate_cos_sin: torch.Tensor,
    w_k: torch.Tensor,
    k_norm: torch.Tensor,
    block_size: int,
    k_scale: float = 1.0,
) -> torch.Tensor:
    """Summaries `[N, H_kv, Dg]` fp32 of whole blocks.

    k_buffer: `[slots, H_kv, D]` post-RoPE keys (an fp8 cache holds K / k_scale: the keys summarized are the
    stored numbers times k_scale); pages, block_starts: `[N]` (physical page, first position); model_cos_sin:
    `[max_pos, D]` the model's RoPE table; gate_cos_sin: `[max_pos, Dg]`; w_k: `[H_kv, 3D, Dg]`; k_norm: `[Dg]`.
    See `torch_path.summarize_pages`.
    """
    if k_buffer.is_cuda:
        from sas_backend.ops.summary.triton import summarize_pages_triton

        return summarize_pages_triton(
            k_buffer, pages, block_starts, model_cos_sin, gate_cos_sin, w_k, k_norm, block_size, k_scale
        )
    return torch_path.summarize_pages(
        k_buffer, pages, block_starts, model_cos_sin, gate_cos_sin, w_k, k_norm, block_size, k_scale
    )


def update_summaries(
    k_buffer: torch.Tensor,
    summaries: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    model_cos_sin: torch.Tensor,
    gate_cos_sin: torch.Tensor,
    w_k: torch.Tensor,
    k_norm: torch.Tensor,
    k_scale: float = 1.0,
) -> torch.Tensor:
    """Summarize, in place, the block each request's newest token completed (if it did).

    summaries: `[num_pages, H_kv, Dg]` (row = physical page); block_table: `[bs, >= M + 1]` KV
    slot of each logical block's first token; seq_lens: `[bs]`; the rest as `summarize_pages`.
    Every page a request owns ends up as `naive.summary_update_decode` leaves it; a request that
    completed no block writes nothing (CUDA) or into page 0, SGLang's padding page (CPU).
    Returns summaries.
    """
    if k_buffer.is_cuda:
        from sas_backend.ops.summary.triton import summary_update_decode_triton

        return summary_update_decode_triton(
            k_buffer, summaries, block_table, seq_lens, block_size, model_cos_sin, gate_cos_sin, w_k, k_norm, k_scale
        )
    return torch_path.summary_update_decode_masked(
        k_buffer, summaries, block_table, seq_lens, block_size, model_cos_sin, gate_cos_sin, w_k, k_norm, k_scale
    )


def summarize_listed(k_buffer: torch.Tensor, summaries_out: torch.Tensor, pages: torch.Tensor, starts: torch.Tensor,
                     count: torch.Tensor, block_size: int, model_cos_sin: torch.Tensor, gate_cos_sin: torch.Tensor,
                     w_k: torch.Tensor, k_norm: torch.Tensor, k_scale: float = 1.0,
                     sub_blocks: int = 1) -> torch.Tensor:
    """Summarize the first `count` listed whole blocks into their pages, in place.

    pages, starts: `[L]` int64 (physical page, first position) of which the first count are read; count: `[1]`
    int64 (on the device: no host sync on CUDA); summaries_out `[num_pages, H_kv, n * Dg]` with n = sub_blocks
    summaries a block (run j: tokens j*S .. (j+1)*S - 1, S = b / n, in columns j*Dg ..); the rest as
    `summarize_pages`. Returns summaries_out.
    """
    if k_buffer.is_cuda:
        from sas_backend.ops.summary.triton import summarize_listed_triton

        return summarize_listed_triton(k_buffer, summaries_out, pages, starts, count, block_size, model_cos_sin,
                                       gate_cos_sin, w_k, k_norm, k_scale, sub_blocks)
    return torch_path.summarize_listed(k_buffer, summaries_out, pages, starts, count, block_size, model_cos_sin,
                                      gate_cos_sin, w_k, k_norm, k_scale, sub_blocks)


__all__ = [
    "completed_blocks", "run_pages", "runs_per_block", "summarize_listed", "summarize_pages", "update_summaries",
]
