"""KV index building (Triton): fill the token rows of every (request, kv head).

Same contents as `sas_backend.ops.gather.torch_path.build_kv_indices`. The row offsets
(`kv_indptr`) come from `kv_indptr_for`, computed outside the CUDA graph from host sequence
lengths (FlashInfer plans with them); inside the graph this kernel only fills a preallocated
`kv_indices` buffer, reading seq_lens and the selection on device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl



@triton.jit
def _build_kv_indices_kernel(
    sel_ptr,
    seq_ptr,
    bt_ptr,
    indptr_ptr,
    out_ptr,
    stride_selb,
    stride_selh,
    stride_bt,
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
    bt_row = bt_ptr + r.to(tl.int64) * stride_bt
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
        # A page is one block: token o of block m sits at slot block_table[r, m] + o.
        first = tl.load(bt_row + blk, mask=ok, other=0).to(tl.int64)
        slot = first[:, None] + offs[None, :]
        dst = row_start + rank[:, None] * BLOCK_SIZE + offs[None, :]
        tl.store(out_ptr + dst, (slot.to(tl.int64) * H_KV + h).to(tl.int32), mask=tmask)
        written += tl.sum(ok_i, axis=0)

    # Current block up to the newest token (it starts right after the candidate blocks).
    cur = tl.maximum(seq_len - 1, 0) // BLOCK_SIZE
    pmask = omask & (cur * BLOCK_SIZE + offs < seq_len)
    slot = tl.load(bt_row + cur).to(tl.int64) + offs
    dst = row_start + written * BLOCK_SIZE + offs
    tl.store(out_ptr + dst, (slot.to(tl.int64) * H_KV + h).to(tl.int32), mask=pmask)


def build_kv_indices_triton(
    selected: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int, kv_indptr: torch.Tensor,
    kv_indices_out: torch.Tensor,
) -> torch.Tensor:
    """`ops.gather.gather_kv_indices` on CUDA (its docstring has the shapes); capturable.

    Kernel terms: block_table last axis contiguous; seq_lens on device; entries of kv_indices_out past
    `kv_indptr[-1]` are untouched. Row (r, h) gets its selected blocks (all b tokens each), then the current
    block up to the newest token, as index = slot * H_kv + h."""
    bs, h_kv, k = selected.shape
    if selected.stride(-1) != 1 or block_table.stride(-1) != 1:
        raise ValueError("selected and block_table must be contiguous along their last axis")
    if kv_indices_out.dtype != torch.int32:
        raise ValueError("kv_indices_out must be int32")
    if bs == 0 or h_kv == 0:
        return kv_indices_out
    _build_kv_indices_kernel[(bs, h_kv)](
        selected,
        seq_lens,
        block_table,
        kv_indptr,
        kv_indices_out,
        selected.stride(0),
        selected.stride(1),
        block_table.stride(0),
        h_kv,
        k,
        BLOCK_SIZE=block_size,
        BLOCK_B=triton.next_power_of_2(block_size),
        K_CHUNK=max(1, min(64, triton.next_power_of_2(max(k, 1)))),
    )
    return kv_indices_out
