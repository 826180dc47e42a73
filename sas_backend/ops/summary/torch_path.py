"""Block summaries, the torch path: Kmaxminavg pooling, projection, RMSNorm, RoPE at the block's start.

- `pool_block_keys`, `summarize_blocks`, `summarize_pooled`: from pre-RoPE keys (the HF model's gate module,
  training on cached features).
- `summarize_pages`: whole blocks read back from the paged KV cache (post-RoPE keys).
- `summary_update_decode_masked`: the decode-time update without a host decision. The reference
  (`naive.summary_update_decode`) asks the host which requests completed a block; under a CUDA graph (and its CPU
  contract test) that decision must stay on the device. Here every request summarizes its last complete block
  and writes it to its page if the newest token completed it, otherwise to page 0, SGLang's padding page, which
  no request ever owns.
- `summarize_listed`: the blocks a decode step listed as late (their pages' validity marks were off); the host
  reads the count (the capturable form is the Triton kernel's).
"""

from __future__ import annotations

import torch

from sas_backend.ops import FP8_DTYPES
from sas_backend.ops.gate import rms_norm
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
    k_buffer: torch.Tensor, pages: torch.Tensor, block_starts: torch.Tensor, model_cos_sin: torch.Tensor,
    gate_cos_sin: torch.Tensor, w_k: torch.Tensor, k_norm: torch.Tensor, block_size: int, k_scale: float = 1.0,
) -> torch.Tensor:
    """Summaries of whole blocks read back from the paged KV cache.

    k_buffer: `[slots, H_kv, D]` post-RoPE keys (as SGLang stores them; fp8: K / k_scale, read back as the
    stored numbers times k_scale in fp32); the block in physical
    page p occupies slots `p*b .. p*b+b-1` in position order. pages, block_starts: `[N]` (the
    block's physical page and its first position). model_cos_sin: the model's own RoPE table
    `[max_pos, D]` (used to undo its RoPE); gate_cos_sin: the gate's table `[max_pos, Dg]`.
    Returns `[N, H_kv, Dg]` fp32.
    """
    offs = torch.arange(block_size, device=k_buffer.device)
    slots = pages.long()[:, None] * block_size + offs[None, :]  # [N, b]
    positions = block_starts.long()[:, None] + offs[None, :]  # [N, b]
    k_post = k_buffer[slots]  # [N, b, H_kv, D]
    if k_post.dtype in FP8_DTYPES or k_scale != 1.0:
        k_post = k_post.float() * k_scale
    k_pre = invert_rope(k_post, model_cos_sin[positions])
    return summarize_blocks(k_pre, w_k, k_norm, gate_cos_sin[block_starts.long()])


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
    k_buffer: torch.Tensor, summaries_out: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
    block_size: int, model_cos_sin: torch.Tensor, gate_cos_sin: torch.Tensor, w_k: torch.Tensor, k_norm: torch.Tensor,
    k_scale: float = 1.0,
) -> torch.Tensor:
    """Same effect on every page a request owns as `summary_update_decode`; fixed shapes.

    Inputs as `naive.summary_update_decode` (block_table `[bs, >= cur + 1]`).
    Returns summaries_out `[num_pages, H_kv, Dg]`.
    """
    done, pages, starts = completed_blocks(block_table, seq_lens, block_size)
    summ = summarize_pages(k_buffer, pages, starts, model_cos_sin, gate_cos_sin, w_k, k_norm, block_size, k_scale)
    summaries_out.index_copy_(0, torch.where(done, pages, 0), summ.to(summaries_out.dtype))
    return summaries_out


def summarize_listed(
    k_buffer: torch.Tensor, summaries_out: torch.Tensor, pages: torch.Tensor, starts: torch.Tensor,
    count: torch.Tensor, block_size: int, model_cos_sin: torch.Tensor, gate_cos_sin: torch.Tensor, w_k: torch.Tensor,
    k_norm: torch.Tensor, k_scale: float = 1.0, sub_blocks: int = 1, fixed_shapes: "bool | None" = None,
) -> torch.Tensor:
    """Summarize the first `count` listed blocks into their pages, in place (`ops.summary.summarize_listed`). With
    n = sub_blocks, run j of a block (its tokens j*S .. (j+1)*S - 1, S = b / n) is summarized as a block of S tokens
    at position start + j*S into columns j*Dg .. (j+1)*Dg - 1 of summaries_out `[num_pages, H_kv, n * Dg]`.

    fixed_shapes False (default on CPU): the count is read on the host and only the listed blocks are summarized.
    True (default elsewhere: a device without the Triton kernel, the tests' `meta` stand-in for one): every entry is
    summarized and those past the count write page 0, SGLang's padding page: capturable, at the cost of the whole
    list every layer."""
    if not (k_buffer.device.type != "cpu" if fixed_shapes is None else fixed_shapes):
        n = int(count.reshape(-1)[0])
        if n == 0:
            return summaries_out
        rows = pages[:n].long()
        summaries_out[rows] = _listed_runs(k_buffer, rows, starts[:n], block_size, model_cos_sin, gate_cos_sin, w_k,
                                           k_norm, k_scale, sub_blocks).to(summaries_out.dtype)
        return summaries_out
    listed = torch.arange(pages.shape[0], device=pages.device) < count.reshape(-1)[0]
    rows = torch.where(listed, pages.long(), 0)
    summ = _listed_runs(k_buffer, rows, torch.where(listed, starts.long(), 0), block_size, model_cos_sin, gate_cos_sin,
                        w_k, k_norm, k_scale, sub_blocks)
    summaries_out.index_copy_(0, rows, summ.to(summaries_out.dtype))
    return summaries_out


def run_pages(pages: torch.Tensor, starts: torch.Tensor, sub_blocks: int, run_size: int):
    """The runs of whole blocks as pages of `run_size` tokens: pages, starts `[N]` -> (run pages, run starts)
    `[N * sub_blocks]`, run j of physical page p being run page p * sub_blocks + j (its first slot p*b + j*run_size),
    in block order. A sub-block summary is the summary of its run page (every reader's layout)."""
    j = torch.arange(sub_blocks, device=pages.device)
    return ((pages.long()[:, None] * sub_blocks + j).reshape(-1),
            (starts.long()[:, None] + j * run_size).reshape(-1))


def runs_per_block(run_summaries: torch.Tensor, sub_blocks: int) -> torch.Tensor:
    """`[N * n, H_kv, S]` run summaries (n = sub_blocks, in `run_pages` order) -> `[N, H_kv, n * S]`, run j in
    columns j*S .. (j+1)*S - 1: the summary pool's row of a block."""
    rows, h_kv, width = run_summaries.shape
    return (run_summaries.view(rows // sub_blocks, sub_blocks, h_kv, width).transpose(1, 2)
            .reshape(rows // sub_blocks, h_kv, sub_blocks * width))


def _listed_runs(k_buffer, pages, starts, block_size, model_cos_sin, gate_cos_sin, w_k, k_norm, k_scale,
                 sub_blocks) -> torch.Tensor:
    """`[N, H_kv, n * Dg]` fp32 summaries of N whole blocks, n = sub_blocks runs each (see `summarize_listed`)."""
    size = block_size // sub_blocks
    pages_r, starts_r = run_pages(pages, starts, sub_blocks, size)
    runs = summarize_pages(k_buffer, pages_r, starts_r, model_cos_sin, gate_cos_sin, w_k, k_norm, size, k_scale)
    return runs_per_block(runs, sub_blocks)
