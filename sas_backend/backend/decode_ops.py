"""The decode step's ops, one implementation per device, behind one small interface.

Per sparse layer the backend calls, top to bottom:

    update_summaries(plan, layer_id, k_buffer, summaries, gate)   # block completed this step
    selected = select(plan, q, summaries, gate)                   # gate query -> scores -> Top-K
    out = attend(plan, q, k_buffer, v_buffer, selected, scale)    # over selected + current block

`TorchDecodeOps` (CPU) batches the whole step in a few tensor ops; `TritonDecodeOps` (CUDA) runs
the Triton kernels and FlashInfer. Both read the per-step state only from `plan.step` (see
decode_plan.py), so both are safe under CUDA graphs. The plain references in `ops/*/naive.py`
stay the statement of the semantics and the tests' oracle for both.
"""

from __future__ import annotations

from typing import Dict

import torch

from sas_backend.backend.decode_plan import DecodePlan
from sas_backend.gate.module import AttnGate


class TorchDecodeOps:
    """CPU: batched torch ops, no Python loop over requests or kv heads."""

    def __init__(self, cfg, num_kv_heads: int, model_rope_table, gate_rope_table):
        self.cfg = cfg
        self.block_size = cfg.block_size
        self.num_kv_heads = num_kv_heads
        self.model_rope_table = model_rope_table
        self.gate_rope_table = gate_rope_table
        self._w_q_flat: Dict[int, torch.Tensor] = {}

    def summarize_pages(self, k_buffer, pages, starts, gate: AttnGate) -> torch.Tensor:
        """Summaries `[N, H_kv, Dg]` of whole blocks (physical `pages`, first positions `starts`)."""
        from sas_backend.ops.summary.naive import summarize_pages

        return summarize_pages(
            k_buffer, pages, starts, self.model_rope_table, self.gate_rope_table,
            gate.attngate_linear_k.weight, gate.attngate_knorm.weight, self.block_size,
        )

    def update_summaries(self, plan: DecodePlan, k_buffer, summaries, gate: AttnGate) -> None:
        from sas_backend.ops.summary.cpu import summary_update_decode_masked

        step = plan.step
        first_slot, seq_lens = step.block_first_slot, step.seq_lens
        if not plan.graph:  # eager: the host knows which rows completed a block; only those work
            if plan.summary_rows is None:
                return
            first_slot, seq_lens = first_slot[plan.summary_rows], seq_lens[plan.summary_rows]
        summary_update_decode_masked(
            k_buffer, summaries, first_slot, seq_lens, self.block_size,
            self.model_rope_table, self.gate_rope_table,
            gate.attngate_linear_k.weight, gate.attngate_knorm.weight,
        )

    def _flat_q_weight(self, gate: AttnGate) -> torch.Tensor:
        w = self._w_q_flat.get(id(gate))
        if w is None:
            h_kv, g, d, dg = gate.attngate_linear_q.weight.shape
            w = self._w_q_flat[id(gate)] = gate.attngate_linear_q.weight.float().reshape(h_kv, g * d, dg)
        return w

    def select(self, plan: DecodePlan, q: torch.Tensor, summaries, gate: AttnGate) -> torch.Tensor:
        """q `[bs, H_q, D]` post-RoPE -> selected `[bs, H_kv, K]` int32 (ascending, -1 padded)."""
        from sas_backend.ops.gate.cpu import gate_query_cpu
        from sas_backend.ops.score.cpu import score_pages
        from sas_backend.ops.topk.cpu import select_blocks_cpu

        step = plan.step
        gate_q = gate_query_cpu(q, step.model_inv, self._flat_q_weight(gate), gate.attngate_qnorm.weight, step.gate_rot)
        pages = torch.div(step.block_first_slot[:, : plan.max_blocks], self.block_size, rounding_mode="floor")
        scores = score_pages(gate_q, summaries, pages, step.block_valid)
        return select_blocks_cpu(scores, step.num_candidates, self.cfg.top_k, self.cfg.sink_blocks, self.cfg.local_blocks)

    def attend(self, plan: DecodePlan, q, k_buffer, v_buffer, selected, scale: float) -> torch.Tensor:
        """Attention `[bs, H_q, Dv]` over the selected blocks plus the current block."""
        from sas_backend.ops.sparse_decode.cpu import padded_token_rows, sparse_decode_padded

        rows, valid = padded_token_rows(
            selected, plan.step.block_first_slot, plan.step.seq_lens, self.num_kv_heads, self.block_size
        )
        return sparse_decode_padded(q, k_buffer, v_buffer, rows, valid, scale)


class TritonDecodeOps:
    """CUDA: Triton kernels (summary, gate query, scores, Top-K, index gather) and FlashInfer."""

    def __init__(self, cfg, num_kv_heads: int, model_rope_table, gate_rope_table, req_to_token, flashinfer):
        from sas_backend.ops.gather.triton import build_kv_indices_triton
        from sas_backend.ops.score.triton import score_blocks_triton
        from sas_backend.ops.summary.triton import summarize_pages_triton, summary_update_decode_triton
        from sas_backend.ops.topk.triton import select_blocks_triton

        self.cfg = cfg
        self.block_size = cfg.block_size
        self.num_kv_heads = num_kv_heads
        self.model_rope_table = model_rope_table
        self.gate_rope_table = gate_rope_table
        self.req_to_token = req_to_token
        self.flashinfer = flashinfer
        self._summarize_pages = summarize_pages_triton
        self._summary_update = summary_update_decode_triton
        self._score = score_blocks_triton
        self._select = select_blocks_triton
        self._gather = build_kv_indices_triton
        self._gate_query = _gate_query_post_rope()

    def summarize_pages(self, k_buffer, pages, starts, gate: AttnGate) -> torch.Tensor:
        return self._summarize_pages(
            k_buffer, pages, starts, self.model_rope_table, self.gate_rope_table,
            gate.attngate_linear_k.weight, gate.attngate_knorm.weight, self.block_size,
        )

    def update_summaries(self, plan: DecodePlan, k_buffer, summaries, gate: AttnGate) -> None:
        step = plan.step
        self._summary_update(
            k_buffer, summaries, self.req_to_token, step.req_pool_indices, step.seq_lens, self.block_size,
            self.model_rope_table, self.gate_rope_table,
            gate.attngate_linear_k.weight, gate.attngate_knorm.weight,
        )

    def select(self, plan: DecodePlan, q: torch.Tensor, summaries, gate: AttnGate) -> torch.Tensor:
        step = plan.step
        gate_q = self._gate_query(
            q, step.model_cos_sin, gate.attngate_linear_q.weight, gate.attngate_qnorm.weight, step.gate_cos_sin
        )
        scores = self._score(
            gate_q, summaries, self.req_to_token, step.req_pool_indices, step.seq_lens, self.block_size,
            plan.max_blocks,
        )
        return self._select(scores, step.num_candidates, self.cfg.top_k, self.cfg.sink_blocks, self.cfg.local_blocks)

    def attend(self, plan: DecodePlan, q, k_buffer, v_buffer, selected, scale: float) -> torch.Tensor:
        step = plan.step
        self._gather(
            selected, step.seq_lens, self.req_to_token, step.req_pool_indices, self.block_size,
            plan.kv_indptr, plan.kv_indices,
        )
        return self.flashinfer.run(q, k_buffer, v_buffer)


def _gate_query_post_rope():
    """The fused gate-query kernel when this build has it, else the reference composition."""
    try:
        from sas_backend.ops.gate import gate_query_post_rope

        return gate_query_post_rope
    except ImportError:  # pragma: no cover - the kernel lands with ops/gate/triton.py
        from sas_backend.ops.gate.naive import gate_query
        from sas_backend.ops.rope import invert_rope

        def composed(q, model_cos_sin, w_q, q_norm, gate_cos_sin):
            return gate_query(invert_rope(q, model_cos_sin), w_q, q_norm, gate_cos_sin)

        return composed
