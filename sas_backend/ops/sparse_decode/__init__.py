"""Sparse decode attention: ONE entry point that picks the implementation by device.

`make_sparse_decode(...)` returns an object with FlashInfer's plan-once, run-many shape:

    sd.plan(seq_lens_host, scale, graph_bs=None)      # host, once per step, outside any graph
    out = sd.run(q, k_buffer, v_buffer, selected, block_table, seq_lens)   # per sparse layer

CUDA: `flashinfer.FlashInferSparseDecode` (the gather kernel fills the planned token rows, then
FlashInfer's paged decode). Elsewhere: `torch_path.TorchSparseDecode` (a padded gather and one masked
SDPA). `naive.sparse_decode_attention` over `ops.gather` rows is the plain statement and the oracle.
"""

from __future__ import annotations

from typing import Optional

import torch

from sas_backend.ops.sparse_decode.torch_path import TorchSparseDecode


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
):
    """The sparse decode for `device`: per-rank geometry (H_kv, G, D), K and b, at most `max_rows`
    (request, kv head) rows per step; dtypes and a shareable float workspace matter on CUDA only."""
    if torch.device(device).type == "cuda":
        from sas_backend.ops.sparse_decode.flashinfer import FlashInferSparseDecode

        return FlashInferSparseDecode(
            num_kv_heads, group_size, head_dim, q_dtype, kv_dtype, device, max_rows, top_k, block_size,
            workspace=workspace,
        )
    return TorchSparseDecode(num_kv_heads, block_size)


__all__ = ["make_sparse_decode", "TorchSparseDecode"]
