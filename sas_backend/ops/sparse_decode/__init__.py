"""Sparse decode attention: ONE entry point that picks the implementation by device.

`make_sparse_decode(...)` returns a `SparseDecode` (the protocol both implementations follow), FlashInfer's
plan-once, run-many shape:

    sd.plan(seq_lens_host, scale, graph_bs=None)      # host, once per step, outside any graph
    out = sd.run(q, k_buffer, v_buffer, selected, block_table, seq_lens)   # per sparse layer

CUDA: `flashinfer.FlashInferSparseDecode` (the gather kernel fills the planned token rows, then
FlashInfer's paged decode). Elsewhere: `torch_path.TorchSparseDecode` (a padded gather and one masked
SDPA). `naive.sparse_decode_attention` over `ops.gather` rows is the plain statement and the oracle.
"""

from __future__ import annotations

from typing import Optional, Protocol, runtime_checkable

import torch

from sas_backend.ops.sparse_decode.torch_path import TorchSparseDecode


@runtime_checkable
class SparseDecode(Protocol):
    """What the decode step drives (`backend.decode_step.DecodeStep`); both implementations follow it."""

    def plan(self, seq_lens_host: torch.Tensor, scale: float, graph_bs: Optional[int] = None) -> None:
        """Once per step on the host, outside any graph: the batch `[bs]` host lengths and the softmax scale
        (graph_bs: a captured batch size, whose buffers a graph replays)."""

    def run(self, q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, selected: torch.Tensor,
            block_table: torch.Tensor, seq_lens: torch.Tensor, k_scale: float = 1.0,
            v_scale: float = 1.0) -> torch.Tensor:
        """Per sparse layer: attention `[bs, H_q, Dv]` of q `[bs, H_q, D]` over the selected blocks `[bs, H_kv, K]`
        (int32 ascending, -1 padded) plus each row's current block; k/v buffers `[slots, H_kv, D]` (fp8: K / k_scale,
        V / v_scale); block_table `[bs, >= cur + 1]` KV slot of each logical block's first token; seq_lens `[bs]`."""

    def device_nbytes(self) -> int:
        """Persistent device bytes it holds."""


def make_sparse_decode(
    device: torch.device,
    num_kv_heads: int,
    group_size: int,
    head_dim: int,
    top_k: int,
    block_size: int,
    max_rows: int,
    q_dtype: torch.dtype,
    kv_dtype: torch.dtype,
    workspace: Optional[torch.Tensor] = None,
) -> SparseDecode:
    """The sparse decode for `device`: per-rank geometry (H_kv, G, D), K and b, at most `max_rows`
    (request, kv head) rows per step; dtypes and a shareable float workspace matter on CUDA only."""
    if torch.device(device).type == "cuda":
        from sas_backend.ops.sparse_decode.flashinfer import FlashInferSparseDecode

        return FlashInferSparseDecode(
            num_kv_heads, group_size, head_dim, q_dtype, kv_dtype, device, max_rows, top_k, block_size,
            workspace=workspace,
        )
    return TorchSparseDecode(num_kv_heads, block_size)


__all__ = ["SparseDecode", "TorchSparseDecode", "make_sparse_decode"]
