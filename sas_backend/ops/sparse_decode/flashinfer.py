"""Sparse decode through FlashInfer: one decode row per (request, kv head).

The KV cache `[slots, H_kv, D]` is viewed as `[slots * H_kv, page=1, heads=1, D]` (NHD), so each
row is a plain token list (`kv_indices`, index = slot * H_kv + h) and the G query heads of the
group are that row's query heads. Plan once per step on the host (row lengths are known from
host sequence lengths), fill the indices on the device, run per layer. With CUDA graphs, one
wrapper per captured batch size over fixed buffers (FlashInfer's `use_cuda_graph=True`).
"""

from __future__ import annotations

import torch


class FlashInferSparseDecode:
    """Plan-once, run-many wrapper.

    num_kv_heads, group_size, head_dim: per-rank attention geometry (H_kv, G = H_q // H_kv, D).
    max_rows: most (request, kv head) rows; max_indices: capacity of the index buffer.
    """

    def __init__(self, num_kv_heads, group_size, head_dim, q_dtype, kv_dtype, device, max_rows, max_indices):
        import flashinfer

        self._flashinfer = flashinfer
        self.num_kv_heads = num_kv_heads
        self.group_size = group_size
        self.head_dim = head_dim
        self.q_dtype = q_dtype
        self.kv_dtype = kv_dtype
        self.workspace = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device=device)
        self.indptr_buf = torch.zeros(max_rows + 1, dtype=torch.int32, device=device)
        self.indices_buf = torch.zeros(max_indices, dtype=torch.int32, device=device)
        self.last_page_len_buf = torch.ones(max_rows, dtype=torch.int32, device=device)
        # Tensor cores pay off for wider groups (FlashInfer's advice for GQA >= 4), and the
        # prefill-based path also takes group sizes the CUDA-core decode kernel has no build for.
        self.use_tensor_cores = group_size >= 4 or group_size not in (1, 2)
        self._eager = self._make_wrapper(cuda_graph=False, rows=None)
        self._graph_wrappers = {}
        self._active = self._eager

    def _make_wrapper(self, cuda_graph: bool, rows):
        fi = self._flashinfer
        if not cuda_graph:
            return fi.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_tensor_cores=self.use_tensor_cores
            )
        return fi.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace,
            "NHD",
            use_cuda_graph=True,
            use_tensor_cores=self.use_tensor_cores,
            paged_kv_indptr_buffer=self.indptr_buf[: rows + 1],
            paged_kv_indices_buffer=self.indices_buf,
            paged_kv_last_page_len_buffer=self.last_page_len_buf[:rows],
        )

    def plan(self, kv_indptr_host: torch.Tensor, scale: float, graph_bs=None) -> torch.Tensor:
        """Plan one decode step from host row offsets `[rows + 1]`; returns the index buffer to fill.

        graph_bs: the captured batch size when planning for a CUDA graph (capture or replay).
        """
        rows = kv_indptr_host.numel() - 1
        if graph_bs is None:
            wrapper = self._eager
        else:
            wrapper = self._graph_wrappers.get(graph_bs)
            if wrapper is None:
                wrapper = self._graph_wrappers[graph_bs] = self._make_wrapper(True, rows)
        indptr = kv_indptr_host.to(torch.int32)
        wrapper.plan(
            indptr,  # host tensor: FlashInfer schedules on the host and copies it over itself
            self.indices_buf,
            self.last_page_len_buf[:rows],
            self.group_size,
            1,
            self.head_dim,
            1,
            q_data_type=self.q_dtype,
            kv_data_type=self.kv_dtype,
            sm_scale=scale,
        )
        self._active = wrapper
        return self.indices_buf

    def run(self, q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor) -> torch.Tensor:
        """q `[bs, H_q, D]`, k/v buffers `[slots, H_kv, D]` -> `[bs, H_q, Dv]`, over the planned rows."""
        bs, h_q, d = q.shape
        slots = k_buffer.shape[0]
        k_rows = k_buffer.view(slots * self.num_kv_heads, 1, 1, d)
        v_rows = v_buffer.view(slots * self.num_kv_heads, 1, 1, v_buffer.shape[-1])
        q_rows = q.reshape(bs * self.num_kv_heads, self.group_size, d)
        out = self._active.run(q_rows, (k_rows, v_rows))
        return out.view(bs, h_q, -1)
