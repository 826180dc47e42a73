"""Block scores (Triton): gate query against the paged block summaries of each request.

Same semantics as `sas_backend.ops.score.torch_path.score_blocks`. One program per
(request, kv head, tile of logical blocks). Sequence lengths are read on device and
`max_blocks` is a fixed Python int, so the launch is CUDA-graph capturable.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl


@triton.jit
def _score_blocks_kernel(
    q_ptr,
    summ_ptr,
    bt_ptr,
    ncand_ptr,
    out_ptr,
    stride_qb,
    stride_qh,
    stride_qd,
    stride_sp,
    stride_sh,
    stride_sd,
    stride_bt,
    stride_ob,
    stride_oh,
    max_blocks,
    sm_scale,
    DG: tl.constexpr,
    BLOCK_DG: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    SUB: tl.constexpr = 1,
):
    r = tl.program_id(0)
    h = tl.program_id(1)
    m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)

    # Candidates are the complete blocks before the one holding the newest token.
    n_cand = tl.load(ncand_ptr + r).to(tl.int64)
    out_row = out_ptr + r * stride_ob + h * stride_oh
    # Tiles past the row's candidates only write -inf: the grid is sized by the server's
    # maximum context, the work by the batch's actual lengths.
    if tl.program_id(2) * BLOCK_M >= n_cand:
        tl.store(out_row + m, tl.full([BLOCK_M], float("-inf"), tl.float32), mask=m < max_blocks)
        return
    valid = m < n_cand

    # Logical block m lives in physical page block_table[r, m] // b.
    slot = tl.load(bt_ptr + r.to(tl.int64) * stride_bt + m, mask=valid, other=0)
    page = slot.to(tl.int64) // BLOCK_SIZE

    d = tl.arange(0, BLOCK_DG)
    dmask = d < DG
    q = tl.load(q_ptr + r * stride_qb + h * stride_qh + d * stride_qd, mask=dmask, other=0.0).to(tl.float32)
    s_row = summ_ptr + page[:, None] * stride_sp + h * stride_sh
    s = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for u in tl.static_range(SUB):  # the block scores its best run (SUB run summaries side by side, DG columns each)
        kg = tl.load(s_row + (u * DG + d[None, :]) * stride_sd, mask=valid[:, None] & dmask[None, :],
                     other=0.0).to(tl.float32)
        s = tl.maximum(s, tl.sum(kg * q[None, :], axis=1))
    s = s * sm_scale
    s = tl.where(valid, s, float("-inf"))
    tl.store(out_row + m, s, mask=m < max_blocks)


def score_blocks_triton(
    gate_q: torch.Tensor, summaries: torch.Tensor, block_table: torch.Tensor, num_candidates: torch.Tensor,
    block_size: int, max_blocks: int, out: Optional[torch.Tensor] = None, sub_blocks: int = 1,
) -> torch.Tensor:
    """`ops.score.score_blocks` on CUDA (its docstring has the shapes and the rule).

    Kernel terms: gate_q any float dtype; summaries fp32 or bf16; block_table and out last axis contiguous;
    num_candidates read on device (no host sync)."""
    bs, h_kv, dg = gate_q.shape
    if summaries.shape[1:] != (h_kv, sub_blocks * dg):
        raise ValueError(f"summaries {tuple(summaries.shape)} do not match gate_q {tuple(gate_q.shape)}")
    if block_table.stride(-1) != 1:
        raise ValueError("block_table must be contiguous along its last axis")
    if out is None:
        out = torch.empty(bs, h_kv, max_blocks, dtype=torch.float32, device=gate_q.device)
    elif out.shape != (bs, h_kv, max_blocks) or out.dtype != torch.float32 or out.stride(-1) != 1:
        raise ValueError("out must be [bs, H_kv, max_blocks] fp32 with a contiguous last axis")
    if bs == 0 or max_blocks == 0:
        return out
    block_m = min(64, triton.next_power_of_2(max_blocks))
    grid = (bs, h_kv, triton.cdiv(max_blocks, block_m))
    _score_blocks_kernel[grid](
        gate_q,
        summaries,
        block_table,
        num_candidates,
        out,
        gate_q.stride(0),
        gate_q.stride(1),
        gate_q.stride(2),
        summaries.stride(0),
        summaries.stride(1),
        summaries.stride(2),
        block_table.stride(0),
        out.stride(0),
        out.stride(1),
        max_blocks,
        1.0 / math.sqrt(dg),
        DG=dg,
        BLOCK_DG=triton.next_power_of_2(dg),
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        SUB=sub_blocks,
    )
    return out
