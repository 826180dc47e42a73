"""KV index building (Triton): fill the token rows of every (request, kv head).

Same contents as `sas_backend.ops.gather.naive.build_kv_indices`. The row offsets
(`kv_indptr`) come from `kv_indptr_for`, computed outside the CUDA graph from host sequence
lengths (FlashInfer plans with them); inside the graph this kernel only fills a preallocated
`kv_indices` buffer, reading seq_lens and the selection on device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sas_backend.ops.gather.naive import kv_indptr_for


@triton.jit
def _build_kv_indices_kernel(
    sel_ptr,
    seq_ptr,
    r2t_ptr,
    rpi_ptr,
    indptr_ptr,
    out_ptr,
    stride_selb,
    stride_selh,
    stride_r2t,
    H_KV,
    K,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_B: tl.constexpr,
    K_CHUNK: tl.constexpr,
):
    r = tl.program_id(0)
    h = tl.program_id(1)
    row_start = tl.load(indptr_ptr + r * H_KV + h).to(tl.int64)
    seq_len = tl.load(seq_ptr + r).to(tl.int64)
    req = tl.load(rpi_ptr + r).to(tl.int64)
    r2t_row = r2t_ptr + req * stride_r2t
    offs = tl.arange(0, BLOCK_B)
    omask = offs < BLOCK_SIZE

    # Selected blocks, whole: valid entries (>= 0) are packed in their given order.
    written = tl.full([], 0, tl.int64)
    for k0 in range(0, K, K_CHUNK):
        j = k0 + tl.arange(0, K_CHUNK)
        blk = tl.load(sel_ptr + r * stride_selb + h * stride_selh + j, mask=j < K, other=-1).to(tl.int64)
        ok = blk >= 0
        ok_i = ok.to(tl.int64)
        rank = written + tl.cumsum(ok_i, axis=0) - ok_i
        tmask = ok[:, None] & omask[None, :]
        slot = tl.load(r2t_row + blk[:, None] * BLOCK_SIZE + offs[None, :], mask=tmask, other=0)
        dst = row_start + rank[:, None] * BLOCK_SIZE + offs[None, :]
        tl.store(out_ptr + dst, (slot.to(tl.int64) * H_KV + h).to(tl.int32), mask=tmask)
        written += tl.sum(ok_i, axis=0)

    # Current block up to the newest token (it starts right after the candidate blocks).
    cur_start = (tl.maximum(seq_len - 1, 0) // BLOCK_SIZE) * BLOCK_SIZE
    pos = cur_start + offs
    pmask = omask & (pos < seq_len)
    slot = tl.load(r2t_row + pos, mask=pmask, other=0)
    dst = row_start + written * BLOCK_SIZE + offs
    tl.store(out_ptr + dst, (slot.to(tl.int64) * H_KV + h).to(tl.int32), mask=pmask)


def build_kv_indices_triton(
    selected: torch.Tensor,
    seq_lens: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    block_size: int,
    kv_indptr: torch.Tensor,
    kv_indices_out: torch.Tensor,
) -> torch.Tensor:
    """Fill `kv_indices_out` with the token rows of every (request, kv head); capturable.

    selected: `[bs, H_kv, K]` int32 ascending, -1 padded (from `select_blocks`); seq_lens,
    req_pool_indices: `[bs]` (on device); req_to_token: `[max_reqs, max_context]` (last axis
    contiguous); kv_indptr: `[bs*H_kv + 1]` int32 from `kv_indptr_for(seq_lens, K, b, H_kv)`;
    kv_indices_out: int32 buffer with at least `kv_indptr[-1]` entries (the rest is untouched).
    Row (r, h) gets its selected blocks (all b tokens each) then the current block up to the
    newest token, as index = slot * H_kv + h. Returns kv_indices_out.
    """
    bs, h_kv, k = selected.shape
    if selected.stride(-1) != 1 or req_to_token.stride(-1) != 1:
        raise ValueError("selected and req_to_token must be contiguous along their last axis")
    if kv_indices_out.dtype != torch.int32:
        raise ValueError("kv_indices_out must be int32")
    if bs == 0 or h_kv == 0:
        return kv_indices_out
    _build_kv_indices_kernel[(bs, h_kv)](
        selected,
        seq_lens,
        req_to_token,
        req_pool_indices,
        kv_indptr,
        kv_indices_out,
        selected.stride(0),
        selected.stride(1),
        req_to_token.stride(0),
        h_kv,
        k,
        BLOCK_SIZE=block_size,
        BLOCK_B=triton.next_power_of_2(block_size),
        K_CHUNK=max(1, min(64, triton.next_power_of_2(max(k, 1)))),
    )
    return kv_indices_out


def build_kv_indptr_and_indices_triton(
    selected: torch.Tensor,
    seq_lens: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same inputs and result as the naive `build_kv_indices`: (kv_indptr `[bs*H_kv + 1]` int32,
    kv_indices `[kv_indptr[-1]]` int32). Syncs with the host to size the output; not capturable
    (tests and eager use only)."""
    bs, h_kv, k = selected.shape
    indptr = kv_indptr_for(seq_lens, k, block_size, h_kv)
    total = int(indptr[-1]) if indptr.numel() else 0
    indices = torch.empty(total, dtype=torch.int32, device=selected.device)
    build_kv_indices_triton(selected, seq_lens, req_to_token, req_pool_indices, block_size, indptr, indices)
    return indptr, indices
