"""Per-batch decode metadata: what every sparse layer of one decode step shares."""

from __future__ import annotations

import dataclasses

import torch

from sas_backend.ops.gather.naive import kv_indptr_for
from sas_backend.ops.score.naive import candidate_counts


@dataclasses.dataclass
class DecodePlan:
    """Tensors for one decode step, built once per batch and read by every sparse layer.

    positions, seq_lens, req_pool_indices: `[bs]` (device). model_cos_sin: `[bs, D]` rows of the
    model's RoPE table at each new token; gate_cos_sin: `[bs, Dg]`. num_candidates: `[bs]`.
    kv_indptr: `[bs*H_kv + 1]` int32 row offsets (rows = (request, kv head)); kv_indices: a
    buffer of at least kv_indptr[-1] entries that each layer refills. max_blocks: fixed width of
    the score matrix (CUDA-graph friendly).
    """

    positions: torch.Tensor
    seq_lens: torch.Tensor
    req_pool_indices: torch.Tensor
    model_cos_sin: torch.Tensor
    gate_cos_sin: torch.Tensor
    num_candidates: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    max_blocks: int


def host_kv_indptr(seq_lens_cpu: torch.Tensor, top_k: int, block_size: int, num_kv_heads: int) -> torch.Tensor:
    """Row offsets `[bs*H_kv + 1]` int32 on the host, from the host copy of the sequence lengths."""
    return kv_indptr_for(seq_lens_cpu.to(torch.int64), top_k, block_size, num_kv_heads)


def decode_row_capacity(top_k: int, block_size: int) -> int:
    """Most tokens one (request, kv head) row can hold: K whole blocks + the current block."""
    return (top_k + 1) * block_size


__all__ = ["DecodePlan", "host_kv_indptr", "decode_row_capacity", "candidate_counts"]
