"""KV index gather: ONE entry point, the Triton kernel on CUDA, plain torch elsewhere.

`gather_kv_indices` fills the token rows FlashInfer's sparse decode reads (one row per
(request, kv head), index = slot * H_kv + h) into a preallocated buffer, from row offsets
planned on the host (`kv_indptr_for`). The CPU decode path needs no index list: it gathers a
padded view directly (`ops.sparse_decode.torch_path`).
"""

from __future__ import annotations

import torch

from sas_backend.ops.gather.torch_path import build_kv_indices, kv_indptr_for, row_capacity, row_lengths


def gather_kv_indices(
    selected: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    kv_indptr: torch.Tensor,
    kv_indices_out: torch.Tensor,
) -> torch.Tensor:
    """Fill `kv_indices_out` with the token rows of every (request, kv head); returns it.

    selected: `[bs, H_kv, K]` int32 ascending, -1 padded; block_table: `[bs, >= cur + 1]` KV slot
    of each logical block's first token; seq_lens: `[bs]`; kv_indptr: `[bs*H_kv + 1]` int32
    (`kv_indptr_for`); kv_indices_out: int32 `[>= kv_indptr[-1]]`. See `torch_path.build_kv_indices`.
    """
    if selected.is_cuda:
        from sas_backend.ops.gather.triton import build_kv_indices_triton

        return build_kv_indices_triton(selected, block_table, seq_lens, block_size, kv_indptr, kv_indices_out)
    return build_kv_indices(selected, block_table, seq_lens, block_size, kv_indptr, kv_indices_out)


__all__ = ["gather_kv_indices", "kv_indptr_for", "row_capacity", "row_lengths"]
