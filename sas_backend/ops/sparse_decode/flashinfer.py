"""Sparse decode through FlashInfer: one decode row per (request, kv head).

Same interface as the CPU path (`torch_path.TorchSparseDecode`): `plan(seq_lens_host, scale, graph_bs)`
on the host before a step, `run(q, k_buffer, v_buffer, selected, block_table, seq_lens)` per
layer. `run` fills the planned token rows with the gather kernel (`ops.gather`), then decodes.

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

Plan cost: `plan()` of FlashInfer 0.6.12 / 0.6.18 takes `max(kv_lens)` with Python's builtin on
the tensor-core path, a Python loop over every row: with one row per (request, kv head) that is
milliseconds per step at large batches (7 ms at 256 requests x 8 kv heads), on every replay. So,
as SGLang does after capture, each wrapper is planned fully once (which resolves and caches its
module) and from then on with FlashInfer's `fast_decode_plan`, which hands the host offsets
straight to the module's C++ planner (`global_override_indptr_cpu`) and copies nothing: the
device offsets it needs are `gather_indptr`, which every plan refreshes anyway (an async copy
from pinned memory) and which IS the graph wrappers' indptr buffer.
"""

from __future__ import annotations

from typing import Optional

import torch

from sas_backend.ops.gather import gather_kv_indices, kv_indptr_for, row_capacity

# FlashInfer's float workspace for split-KV partial results (its recommended size), and the
# int workspace every wrapper allocates for itself on the device (plus as much pinned host
# memory) in both 0.6.12 and 0.7.2. Used by the memory accounting (backend/memory.py).
WORKSPACE_BYTES = 128 * 1024 * 1024
WRAPPER_INT_WORKSPACE_BYTES = 8 * 1024 * 1024


class FlashInferSparseDecode:
    """Plan-once, run-many wrapper.

    num_kv_heads, group_size, head_dim: per-rank attention geometry (H_kv, G = H_q // H_kv, D).
    max_rows: most (request, kv head) rows; top_k, block_size: K and b (a row holds at most
        K + 1 blocks, which sizes the index buffer the gather kernel fills, `self.indices_buf`).
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
        top_k,
        block_size,
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
        self.top_k = top_k
        self.block_size = block_size
        self.owns_workspace = workspace is None
        self.workspace = (
            torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device) if workspace is None else workspace
        )
        # Device buffers the CUDA-graph wrappers are built over (FlashInfer requires all three).
        self.indices_buf = torch.zeros(max_rows * row_capacity(top_k, block_size), dtype=torch.int32, device=device)
        # Row offsets, read by the gather kernel and by FlashInfer (the graph wrappers' indptr
        # buffer, the eager wrapper's after its first plan): refilled (async copy) by every plan,
        # so a captured gather / decode keeps reading this one address.
        self.gather_indptr = torch.zeros(max_rows + 1, dtype=torch.int32, device=device)
        self._pin = torch.device(device).type == "cuda"  # stage host offsets in pinned memory
        self._rows = None  # rows of the last plan (run checks the batch against it)
        self._planned = set()  # ids of the wrappers planned fully once (then fast_decode_plan)
        self.last_page_len_buf = torch.ones(max_rows, dtype=torch.int32, device=device)
        # Page size 1: every row's last page holds one token. Host copy for plan() (see module doc).
        self._last_page_len_host = torch.ones(max_rows, dtype=torch.int32)
        # Tensor cores pay off for wider groups (FlashInfer's advice for GQA >= 4), and the
        # prefill-based path also takes group sizes the CUDA-core decode kernel has no build for.
        self.use_tensor_cores = group_size >= 4 or group_size not in (1, 2)
        self._eager = self._make_wrapper(cuda_graph=False, rows=None)
        self._graph_wrappers = {}
        self._active = self._eager

    @staticmethod
    def nbytes_for(max_rows: int, top_k: int, block_size: int, wrappers: int, own_workspace: bool) -> int:
        """What `device_nbytes` comes to for an object of this shape once `wrappers` wrappers exist (eager + one per
        captured batch size); counts without FlashInfer installed (`backend.memory`)."""
        buffers = max_rows * row_capacity(top_k, block_size) * 4 + (max_rows + 1) * 4 + max_rows * 4
        return buffers + (WORKSPACE_BYTES if own_workspace else 0) + wrappers * WRAPPER_INT_WORKSPACE_BYTES

    def device_nbytes(self) -> int:
        """Device bytes this object holds: buffers, the workspace if its own, and one FlashInfer
        int workspace per wrapper made so far (eager + one per captured batch size)."""
        own = [self.indices_buf, self.gather_indptr, self.last_page_len_buf]
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
            paged_kv_indptr_buffer=self.gather_indptr[: rows + 1],
            paged_kv_indices_buffer=self.indices_buf,
            paged_kv_last_page_len_buffer=self.last_page_len_buf[:rows],
        )

    def plan(self, seq_lens_host: torch.Tensor, scale: float, graph_bs=None) -> None:
        """Plan one decode step from the HOST sequence lengths `[bs]` (no device-to-host copy).

        Row (r, h) holds min(K, candidates) whole blocks plus the current block
        (`ops.gather.kv_indptr_for`). graph_bs: the captured batch size when planning for a CUDA
        graph (capture or replay); FlashInfer reads indptr / last_page_len on the host.
        """
        if seq_lens_host.device.type != "cpu":
            # A device tensor would make FlashInfer copy the offsets back to the host: a sync per step.
            raise ValueError(f"seq_lens_host must be a CPU tensor, got one on {seq_lens_host.device}")
        indptr = kv_indptr_for(seq_lens_host.to(torch.int64), self.top_k, self.block_size, self.num_kv_heads)
        rows = indptr.numel() - 1
        if rows > self.max_rows:
            raise ValueError(f"{rows} decode rows exceed the planned capacity {self.max_rows}")
        if graph_bs is None:
            wrapper = self._eager
        else:
            wrapper = self._graph_wrappers.get(graph_bs)
            if wrapper is None:
                wrapper = self._graph_wrappers[graph_bs] = self._make_wrapper(True, rows)
        # Async copy from pinned memory (pageable memory can make it synchronous): stream-ordered
        # before this step's gather and decode, which read it.
        host = indptr.pin_memory() if self._pin else indptr
        self.gather_indptr[: rows + 1].copy_(host, non_blocking=True)
        args = (self.group_size, 1, self.head_dim, 1)
        kwargs = dict(q_data_type=self.q_dtype, kv_data_type=self.kv_dtype, sm_scale=scale)
        if id(wrapper) not in self._planned:  # the full plan resolves and caches the wrapper's module
            wrapper.plan(indptr, self.indices_buf, self._last_page_len_host[:rows], *args, **kwargs)
            self._planned.add(id(wrapper))
        else:  # O(1) Python work whatever the row count (see the module doc)
            self._flashinfer.fast_decode_plan(
                wrapper, self.gather_indptr[: rows + 1], self.indices_buf, self.last_page_len_buf[:rows], *args,
                non_blocking=True, global_override_indptr_cpu=indptr, **kwargs,
            )
        self._active = wrapper
        self._rows = rows

    def run(self, q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, selected: torch.Tensor,
            block_table: torch.Tensor, seq_lens: torch.Tensor, k_scale: float = 1.0,
            v_scale: float = 1.0) -> torch.Tensor:
        """Attention `[bs, H_q, Dv]` over the selected blocks plus the current block.

        q: `[bs, H_q, D]`; k/v buffers: `[slots, H_kv, D]` in the planned kv dtype (fp8: holding K / k_scale,
        V / v_scale; FlashInfer folds k_scale into the softmax scale and applies v_scale to the output);
        selected: `[bs, H_kv, K]` int32 ascending, -1 padded; block_table: `[bs, >= cur + 1]` KV slot of each
        logical block's first token; seq_lens: `[bs]` (device). bs must be the planned batch.
        """
        bs, h_q, d = q.shape
        if self._rows is None or bs * self.num_kv_heads != self._rows:
            raise ValueError(f"run() got a batch of {bs} requests; plan() was for {self._rows} rows")
        gather_kv_indices(
            selected, block_table, seq_lens, self.block_size, self.gather_indptr[: self._rows + 1], self.indices_buf
        )
        slots = k_buffer.shape[0]
        k_rows = k_buffer.view(slots * self.num_kv_heads, 1, 1, d)
        v_rows = v_buffer.view(slots * self.num_kv_heads, 1, 1, v_buffer.shape[-1])
        q_rows = q.reshape(bs * self.num_kv_heads, self.group_size, d)
        if k_buffer.dtype != self.kv_dtype:  # FlashInfer would read the bytes as the planned dtype
            raise ValueError(f"k_buffer is {k_buffer.dtype}; the decode was planned for {self.kv_dtype}")
        out = self._active.run(q_rows, (k_rows, v_rows), k_scale=k_scale, v_scale=v_scale)
        return out.view(bs, h_q, -1)
