"""Per-batch decode metadata: what every sparse layer of one decode step shares."""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from sas_backend.ops.gather.naive import kv_indptr_for
from sas_backend.ops.score.naive import candidate_counts


@dataclasses.dataclass
class DecodePlan:
    """Tensors for one decode step, built once per batch and read by every sparse layer.

    Made outside any CUDA graph (host planning). Under CUDA graphs every tensor here must keep
    its address from capture to replay: positions, seq_lens, req_pool_indices are the runner's
    static buffers; kv_indptr and kv_indices are slices of the backend's persistent buffers.
    positions, seq_lens, req_pool_indices: `[bs]`; kv_indptr: `[bs*H_kv + 1]` int32 row offsets
    (rows = (request, kv head)); kv_indices: at least kv_indptr[-1] entries, refilled per layer;
    max_blocks: fixed width of the score matrix.

    The per-step tensors derived on the device (`model_cos_sin` `[bs, D]`, `gate_cos_sin`
    `[bs, Dg]`, `num_candidates` `[bs]`) are computed by the first sparse layer of the step,
    inside the captured region, and shared by the later layers.
    """

    positions: torch.Tensor
    seq_lens: torch.Tensor
    req_pool_indices: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    max_blocks: int
    model_cos_sin: Optional[torch.Tensor] = None
    gate_cos_sin: Optional[torch.Tensor] = None
    num_candidates: Optional[torch.Tensor] = None


def host_kv_indptr(seq_lens_cpu: torch.Tensor, top_k: int, block_size: int, num_kv_heads: int) -> torch.Tensor:
    """Row offsets `[bs*H_kv + 1]` int32 on the host, from the host copy of the sequence lengths."""
    return kv_indptr_for(seq_lens_cpu.to(torch.int64), top_k, block_size, num_kv_heads)


def decode_row_capacity(top_k: int, block_size: int) -> int:
    """Most tokens one (request, kv head) row can hold: K whole blocks + the current block."""
    return (top_k + 1) * block_size


__all__ = ["DecodePlan", "host_kv_indptr", "decode_row_capacity", "candidate_counts"]
