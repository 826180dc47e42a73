"""The `sas` attention backend: dense extend, block-sparse decode.

Wraps a dense SGLang backend (FlashInfer on CUDA, torch-native on CPU) for extend and for the
layers below `first_sparse_layer`. Per sparse layer and decode step:

    write K/V -> summary of a block that just completed -> gate query (q with RoPE undone)
    -> block scores over the request's paged summaries -> Top-K per (request, kv head)
    -> token rows of the selected blocks + the current block -> attention over those rows

CPU runs the plain-torch reference ops; CUDA runs the Triton kernels and FlashInfer, with the
whole decode step capturable in a CUDA graph (plan on the host outside the graph, fill inside).
"""

from __future__ import annotations

import json
import logging
import os
from typing import Dict, Optional

import torch

from sas_backend.backend.decode_plan import DecodePlan, decode_row_capacity, host_kv_indptr
from sas_backend.backend.kv_write import save_kv
from sas_backend.backend.summary_pool import SummaryPool
from sas_backend.config import SASConfig
from sas_backend.gate.module import AttnGate
from sas_backend.ops.gate.naive import gate_query
from sas_backend.ops.rope import invert_rope
from sas_backend.ops.score.naive import candidate_counts

try:
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
except ImportError:  # pragma: no cover - sglang is a hard dependency of the backend
    AttentionBackend = object

logger = logging.getLogger(__name__)


class _Ops:
    """The decode-step ops: plain-torch references (CPU) or Triton kernels (CUDA)."""

    def __init__(self, use_triton: bool):
        if use_triton:
            from sas_backend.ops.gather.triton import build_kv_indices_triton
            from sas_backend.ops.score.triton import score_blocks_triton
            from sas_backend.ops.summary.triton import summarize_pages_triton, summary_update_decode_triton
            from sas_backend.ops.topk.triton import select_blocks_triton

            self.summarize_pages = summarize_pages_triton
            self.summary_update_decode = summary_update_decode_triton
            self.score = score_blocks_triton
            self.select = select_blocks_triton
            self.fill_kv_indices = build_kv_indices_triton
        else:
            from sas_backend.ops.gather.naive import build_kv_indices
            from sas_backend.ops.score.naive import score_blocks
            from sas_backend.ops.summary.naive import summarize_pages, summary_update_decode
            from sas_backend.ops.topk.naive import select_blocks

            self.summarize_pages = summarize_pages
            self.summary_update_decode = summary_update_decode
            self.score = score_blocks
            self.select = select_blocks

            def fill_kv_indices(selected, seq_lens, req_to_token, req_pool_indices, block_size, kv_indptr, out):
                _, indices = build_kv_indices(selected, seq_lens, req_to_token, req_pool_indices, block_size)
                out[: indices.numel()] = indices
                return out

            self.fill_kv_indices = fill_kv_indices


class SASAttnBackend(AttentionBackend):
    """SGLang AttentionBackend for SAS block-sparse decode. Built by `factory.create_sas_backend`."""

    def __init__(
        self,
        runner,
        inner,
        cfg: SASConfig,
        gates: Dict[int, AttnGate],
        model_rope_table: torch.Tensor,
        gate_rope_table: torch.Tensor,
        num_kv_heads: int,
        num_q_heads: int,
        head_dim: int,
    ):
        super().__init__()
        self.inner = inner
        # A wrapper must hand SGLang the wrapped backend's translator (0.5.20+ asserts it).
        self.kv_index_translator = getattr(inner, "kv_index_translator", None)
        self.cfg = cfg
        self.device = torch.device(runner.device) if isinstance(runner.device, str) else runner.device
        self.req_to_token_pool = runner.req_to_token_pool
        self.token_to_kv_pool = runner.token_to_kv_pool
        self.gates = gates
        self.model_rope_table = model_rope_table
        self.gate_rope_table = gate_rope_table
        self.num_kv_heads = num_kv_heads
        self.num_q_heads = num_q_heads
        self.head_dim = head_dim
        self.block_size = cfg.block_size
        self.top_k = cfg.top_k
        self.max_blocks = self.req_to_token_pool.req_to_token.shape[1] // self.block_size
        self.use_cuda = self.device.type == "cuda"
        self.ops = _Ops(use_triton=self.use_cuda)

        num_pages = self.token_to_kv_pool.get_key_buffer(min(gates)).shape[0] // self.block_size
        self.summaries = SummaryPool(sorted(gates), num_pages, num_kv_heads, gate_rope_table.shape[-1], self.device)
        max_reqs = self.req_to_token_pool.req_to_token.shape[0]
        self._kv_indices = torch.zeros(
            max_reqs * num_kv_heads * decode_row_capacity(self.top_k, self.block_size),
            dtype=torch.int32,
            device=self.device,
        )
        self._kv_indptr = torch.zeros(max_reqs * num_kv_heads + 1, dtype=torch.int32, device=self.device)
        self._flashinfer = None
        if self.use_cuda:
            from sas_backend.ops.sparse_decode.flashinfer import FlashInferSparseDecode

            self._flashinfer = FlashInferSparseDecode(
                num_kv_heads,
                num_q_heads // num_kv_heads,
                head_dim,
                runner.dtype,
                self.token_to_kv_pool.get_key_buffer(min(gates)).dtype,
                self.device,
                max_rows=max_reqs * num_kv_heads,
                max_indices=self._kv_indices.numel(),
            )
            self._kv_indices = self._flashinfer.indices_buf
        self._plan: Optional[DecodePlan] = None
        self._extend_blocks = None  # (pages [N], starts [N]) of blocks completed by this extend
        self._scaling = None
        self._debug_step = 0
        logger.info(
            "sas: %d sparse layers from layer %d, budget %d tokens (K=%d blocks of %d), "
            "sink %d, local %d; summary pool %d pages x %d kv heads x %d dims fp32 = %.1f MiB",
            len(gates), cfg.first_sparse_layer, cfg.budget, self.top_k, self.block_size,
            cfg.sink_blocks, cfg.local_blocks, num_pages, num_kv_heads,
            gate_rope_table.shape[-1], self.summaries.nbytes / 2**20,
        )

    # ------------------------------------------------------------------ metadata
    def _inner_needed(self, forward_batch) -> bool:
        # Dense decode metadata (a full-KV FlashInfer plan and index build per step) is only read
        # by layers below first_sparse_layer; without such layers it would be wasted work.
        return self.cfg.first_sparse_layer > 0 or not forward_batch.forward_mode.is_decode()

    def init_forward_metadata(self, forward_batch):
        if self._inner_needed(forward_batch):
            self.inner.init_forward_metadata(forward_batch)
        self._prepare(forward_batch, graph_bs=None)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
        self.inner.init_cuda_graph_state(max_bs, max_num_tokens)

    def get_cuda_graph_seq_len_fill_value(self):
        return self.inner.get_cuda_graph_seq_len_fill_value()

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False):
        if self._inner_needed(forward_batch):
            self.inner.init_forward_metadata_out_graph(forward_batch, in_capture=in_capture)
        self._prepare(forward_batch, graph_bs=forward_batch.batch_size)

    def init_forward_metadata_in_graph(self, forward_batch):
        if self._inner_needed(forward_batch):
            self.inner.init_forward_metadata_in_graph(forward_batch)

    def _prepare(self, fb, graph_bs):
        mode = fb.forward_mode
        if mode.is_decode():
            self._plan = self._plan_decode(fb, graph_bs)
            self._extend_blocks = None
        elif mode.is_extend():
            self._plan = None
            self._extend_blocks = self._plan_extend(fb)

    def _plan_decode(self, fb, graph_bs) -> DecodePlan:
        """Host part of a decode step (outside any CUDA graph): row offsets, FlashInfer plan."""
        seq_lens_cpu = fb.seq_lens_cpu
        if seq_lens_cpu is None:  # only without a CPU mirror (never on the paths we serve)
            seq_lens_cpu = fb.seq_lens.cpu()
        indptr_host = host_kv_indptr(seq_lens_cpu, self.top_k, self.block_size, self.num_kv_heads)
        rows = indptr_host.numel() - 1
        kv_indices = self._kv_indices
        if self._flashinfer is not None:
            kv_indices = self._flashinfer.plan(indptr_host, self._layer_scaling(), graph_bs=graph_bs)
        # A persistent buffer: the captured gather kernel reads the offsets of each replay here.
        kv_indptr = self._kv_indptr[: rows + 1]
        kv_indptr.copy_(indptr_host, non_blocking=True)
        max_blocks = self.max_blocks
        if not self.use_cuda:  # no graphs on CPU: score only as many blocks as the batch has
            max_blocks = max(1, (int(seq_lens_cpu.max()) - 1) // self.block_size)
        return DecodePlan(
            positions=fb.positions,
            seq_lens=fb.seq_lens,
            req_pool_indices=fb.req_pool_indices,
            kv_indptr=kv_indptr,
            kv_indices=kv_indices,
            max_blocks=max_blocks,
        )

    def _step_tensors(self, plan: DecodePlan) -> DecodePlan:
        """Device tensors shared by all sparse layers of a step; made once, inside the graph."""
        if plan.num_candidates is None:
            plan.model_cos_sin = self.model_rope_table[plan.positions]
            plan.gate_cos_sin = self.gate_rope_table[plan.positions]
            plan.num_candidates = candidate_counts(plan.seq_lens, self.block_size)
        return plan

    def _plan_extend(self, fb):
        """Blocks that this extend completes, per request: logical [prefix // b, seq_len // b)."""
        prefix = fb.extend_prefix_lens_cpu
        seq_lens_cpu = fb.seq_lens_cpu
        if prefix is None or seq_lens_cpu is None:
            return None
        reqs, blocks = [], []
        for i, (p, s) in enumerate(zip(list(prefix), seq_lens_cpu.tolist())):
            first, end = int(p) // self.block_size, int(s) // self.block_size
            reqs.extend([i] * (end - first))
            blocks.extend(range(first, end))
        if not blocks:
            return None
        reqs_t = torch.tensor(reqs, dtype=torch.int64, device=self.device)
        starts = torch.tensor(blocks, dtype=torch.int64, device=self.device) * self.block_size
        rows = fb.req_pool_indices.long()[reqs_t]
        pages = torch.div(
            self.req_to_token_pool.req_to_token[rows, starts].long(), self.block_size, rounding_mode="floor"
        )
        return pages, starts

    def _layer_scaling(self) -> float:
        return self._scaling if self._scaling is not None else self.head_dim**-0.5

    # ------------------------------------------------------------------ forward
    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        out = self.inner.forward_extend(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)
        gate = self.gates.get(layer.layer_id)
        if gate is not None and self._extend_blocks is not None:
            pages, starts = self._extend_blocks
            summaries = self.ops.summarize_pages(
                self.token_to_kv_pool.get_key_buffer(layer.layer_id),
                pages,
                starts,
                self.model_rope_table,
                self.gate_rope_table,
                gate.attngate_linear_k.weight,
                gate.attngate_knorm.weight,
                self.block_size,
            )
            self.summaries[layer.layer_id][pages] = summaries
        return out

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        gate = self.gates.get(layer.layer_id)
        if gate is None:
            return self.inner.forward_decode(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)
        self._scaling = layer.scaling
        plan = self._step_tensors(self._plan)
        lid = layer.layer_id
        if save_kv_cache and k is not None and v is not None:
            save_kv(self.token_to_kv_pool, layer, forward_batch.out_cache_loc, k, v)
        k_buffer = self.token_to_kv_pool.get_key_buffer(lid)
        v_buffer = self.token_to_kv_pool.get_value_buffer(lid)
        req_to_token = self.req_to_token_pool.req_to_token
        summaries = self.summaries[lid]

        self.ops.summary_update_decode(
            k_buffer, summaries, req_to_token, plan.req_pool_indices, plan.seq_lens, self.block_size,
            self.model_rope_table, self.gate_rope_table,
            gate.attngate_linear_k.weight, gate.attngate_knorm.weight,
        )
        bs = plan.seq_lens.shape[0]
        q3 = q.reshape(bs, layer.tp_q_head_num, layer.qk_head_dim)
        q_pre = invert_rope(q3, plan.model_cos_sin)
        gate_q = gate_query(q_pre, gate.attngate_linear_q.weight, gate.attngate_qnorm.weight, plan.gate_cos_sin)
        scores = self.ops.score(
            gate_q, summaries, req_to_token, plan.req_pool_indices, plan.seq_lens, self.block_size, plan.max_blocks
        )
        selected = self.ops.select(
            scores, plan.num_candidates, self.top_k, self.cfg.sink_blocks, self.cfg.local_blocks
        )
        kv_indices = self.ops.fill_kv_indices(
            selected, plan.seq_lens, req_to_token, plan.req_pool_indices, self.block_size,
            plan.kv_indptr, plan.kv_indices,
        )
        if self.cfg.debug_dir and lid == self.cfg.first_sparse_layer:
            self._debug_record(plan, selected)
        if self._flashinfer is not None:
            out = self._flashinfer.run(q3, k_buffer, v_buffer)
        else:
            from sas_backend.ops.sparse_decode.naive import sparse_decode_attention

            out = sparse_decode_attention(q3, k_buffer, v_buffer, plan.kv_indptr, kv_indices, layer.scaling)
        return out.reshape(bs, layer.tp_q_head_num * layer.v_head_dim)

    def _debug_record(self, plan: DecodePlan, selected: torch.Tensor) -> None:
        """Append this step's selection (first sparse layer) as one JSON line. Debug/tests only."""
        os.makedirs(self.cfg.debug_dir, exist_ok=True)
        rec = {
            "step": self._debug_step,
            "seq_lens": plan.seq_lens.tolist(),
            "num_candidates": plan.num_candidates.tolist(),
            "selected": selected.tolist(),
        }
        self._debug_step += 1
        with open(os.path.join(self.cfg.debug_dir, f"selection-{os.getpid()}.jsonl"), "a") as f:
            f.write(json.dumps(rec) + "\n")

    def support_triton(self):
        return self.inner.support_triton()
