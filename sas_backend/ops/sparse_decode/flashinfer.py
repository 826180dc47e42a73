"""Sparse decode through FlashInfer: one decode row per (request, kv head).

The KV cache `[slots, H_kv, D]` is viewed as `[slots * H_kv, page=1, heads=1, D]` (NHD), so each
row is a plain token list (`kv_indices`, index = slot * H_kv + h) and the G query heads of the
group are that row's query heads. Plan once per step on the host (row lengths are known from
host sequence lengths), fill the indices on the device, run per layer. With CUDA graphs, one
wrapper per captured batch size over fixed buffers (FlashInfer's `use_cuda_graph=True`).

The host/device contract of `BatchDecodeWithPagedKVCacheWrapper.plan(indptr, indices,
last_page_len, ...)`, read from FlashInfer 0.6.12 and 0.7.2 (the same in both for our path:
fa2 / CUDA-core decode, q_len_per_req 1):

- `indptr`, `last_page_len`: always read on the host (`.to("cpu")`, then the scheduler and
  `get_seq_lens` run on CPU tensors). A device tensor here is a device-to-host copy, i.e. a
  stream sync every step, which stalls SGLang's overlap scheduler. So we pass host tensors.
  Graph wrappers copy them into their fixed device buffers (`copy_(non_blocking=True)`, an
  async host-to-device copy); eager wrappers `.to(device)` them.
- `indices`: never read on the host on these paths (only the cuDNN / trtllm-gen backends,
  which we do not select, build host block tables from it). Eager wrappers keep a reference
  (`.to(device)` is a no-op on a device tensor); graph wrappers copy it into their own
  indices buffer, which here IS the same tensor, so that copy is an aliasing no-op in torch.
  It stays the device buffer that the gather kernel fills inside the graph.
- `run()` reads the wrapper's `_paged_kv_*_buf` device tensors: for graph wrappers those
  are the fixed buffers given to the constructor, so a captured graph keeps reading them.
"""

from __future__ import annotations

from typing import Optional

import torch

# FlashInfer's float workspace for split-KV partial results (its recommended size), and the
# int workspace every wrapper allocates for itself on the device (plus as much pinned host
# memory) in both 0.6.12 and 0.7.2. Used by the memory accounting (backend/memory.py).
WORKSPACE_BYTES = 128 * 1024 * 1024
WRAPPER_INT_WORKSPACE_BYTES = 8 * 1024 * 1024


class FlashInferSparseDecode:
    """Plan-once, run-many wrapper.

    num_kv_heads, group_size, head_dim: per-rank attention geometry (H_kv, G = H_q // H_kv, D).
    max_rows: most (request, kv head) rows; max_indices: capacity of the index buffer.
    indices_buf: optional caller-owned int32 device buffer `[>= max_indices]` for the token
        indices (the one the gather kernel fills); allocated here when not given. Either way
        `self.indices_buf` is the single index buffer.
    workspace: optional uint8 device float workspace to share (e.g. the wrapped SGLang
        FlashInfer backend's `workspace_buffer`: runs are stream-ordered, so sharing is safe);
        a fresh `WORKSPACE_BYTES` one when not given.
    """

    def __init__(
        self,
        num_kv_heads,
        group_size,
        head_dim,
        q_dtype,
        kv_dtype,
        device,
        max_rows,
        max_indices,
        indices_buf: Optional[torch.Tensor] = None,
        workspace: Optional[torch.Tensor] = None,
    ):
        import flashinfer

        self._flashinfer = flashinfer
        self.num_kv_heads = num_kv_heads
        self.group_size = group_size
        self.head_dim = head_dim
        self.q_dtype = q_dtype
        self.kv_dtype = kv_dtype
        self.max_rows = max_rows
        self.owns_workspace = workspace is None
        self.workspace = (
            torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device) if workspace is None else workspace
        )
        # Device buffers the CUDA-graph wrappers are built over (FlashInfer requires all three).
        self.indptr_buf = torch.zeros(max_rows + 1, dtype=torch.int32, device=device)
        if indices_buf is None:
            indices_buf = torch.zeros(max_indices, dtype=torch.int32, device=device)
        elif indices_buf.dtype != torch.int32 or indices_buf.numel() < max_indices:
            raise ValueError(
                f"indices_buf must be int32 with >= {max_indices} elements, got {indices_buf.dtype} "
                f"x {indices_buf.numel()}"
            )
        self.indices_buf = indices_buf
        self.last_page_len_buf = torch.ones(max_rows, dtype=torch.int32, device=device)
        # Page size 1: every row's last page holds one token. Host copy for plan() (see module doc).
        self._last_page_len_host = torch.ones(max_rows, dtype=torch.int32)
        # Tensor cores pay off for wider groups (FlashInfer's advice for GQA >= 4), and the
        # prefill-based path also takes group sizes the CUDA-core decode kernel has no build for.
        self.use_tensor_cores = group_size >= 4 or group_size not in (1, 2)
        self._eager = self._make_wrapper(cuda_graph=False, rows=None)
        self._graph_wrappers = {}
        self._active = self._eager

    def device_nbytes(self) -> int:
        """Device bytes this object holds: buffers, the workspace if its own, and one FlashInfer
        int workspace per wrapper made so far (eager + one per captured batch size)."""
        own = [self.indptr_buf, self.indices_buf, self.last_page_len_buf]
        if self.owns_workspace:
            own.append(self.workspace)
        wrappers = 1 + len(self._graph_wrappers)
        return sum(t.numel() * t.element_size() for t in own) + wrappers * WRAPPER_INT_WORKSPACE_BYTES

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
        """Plan one decode step from HOST row offsets `[rows + 1]`; returns the index buffer to fill.

        graph_bs: the captured batch size when planning for a CUDA graph (capture or replay).
        No device-to-host copy happens here: FlashInfer reads indptr / last_page_len on the host.
        """
        if kv_indptr_host.device.type != "cpu":
            # A device indptr would make FlashInfer copy it back to the host: a sync per step.
            raise ValueError(f"kv_indptr_host must be a CPU tensor, got one on {kv_indptr_host.device}")
        rows = kv_indptr_host.numel() - 1
        if rows > self.max_rows:
            raise ValueError(f"{rows} decode rows exceed the planned capacity {self.max_rows}")
        if graph_bs is None:
            wrapper = self._eager
        else:
            wrapper = self._graph_wrappers.get(graph_bs)
            if wrapper is None:
                wrapper = self._graph_wrappers[graph_bs] = self._make_wrapper(True, rows)
        wrapper.plan(
            kv_indptr_host.to(torch.int32),
            self.indices_buf,
            self._last_page_len_host[:rows],
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
