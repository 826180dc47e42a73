"""Block selection, the first half of a sparse decode step, as one component.

    summaries of complete blocks -> gate query (q with the model's RoPE undone) -> block scores
    -> Top-K per (request, kv head)

Used by the serving backend (SGLang's paged KV cache) and by the transformers evaluation
(`hf/sparse_eval.py`, a contiguous sequence viewed as pages), so both select with the very same
ops. Each step is an `sas_backend.ops` entry point that picks the Triton kernel on CUDA and the
batched torch path elsewhere; all are fixed-shape and capturable in a CUDA graph.

Vocabulary (the ops' docstrings use it too): a page is one block of b tokens; `block_table`
`[bs, >= M + 1]` holds the KV slot of the first token of each logical block of each request
(token o of block m sits at slot block_table[r, m] + o, its summary in row block_table[r, m] // b);
`num_candidates` `[bs]` counts the complete blocks before the current one.
"""

from __future__ import annotations

import dataclasses

import torch

from sas_backend.gate.module import AttnGate
from sas_backend.ops.gate import gate_query_post_rope
from sas_backend.ops.score import score_blocks
from sas_backend.ops.summary import summarize_pages, update_summaries
from sas_backend.ops.topk import select_blocks


@dataclasses.dataclass(frozen=True)
class SelectionRule:
    """What to select: K = budget // b previous blocks per (request, kv head), of which the first
    `sink_blocks` and the `local_blocks` before the current block are forced (inside K)."""

    top_k: int
    block_size: int = 64
    sink_blocks: int = 0
    local_blocks: int = 0


class BlockSelector:
    """Selection under one `SelectionRule`; the gate and RoPE tables come with each call."""

    def __init__(self, rule: SelectionRule):
        self.rule = rule

    def summarize(self, gate: AttnGate, k_buffer, pages, starts, model_table, gate_table) -> torch.Tensor:
        """Summaries `[N, H_kv, Dg]` fp32 of whole blocks in physical `pages` `[N]` with first
        positions `starts` `[N]`. k_buffer: `[slots, H_kv, D]` post-RoPE keys; model_table:
        `[max_pos, D]` the model's cos|sin; gate_table: `[max_pos, Dg]` the gate's."""
        return summarize_pages(
            k_buffer, pages, starts, model_table, gate_table,
            gate.attngate_linear_k.weight, gate.attngate_knorm.weight, self.rule.block_size,
        )

    def update(self, gate: AttnGate, k_buffer, summaries, block_table, seq_lens, model_table, gate_table) -> None:
        """Decode: summarize, into `summaries` `[num_pages, H_kv, Dg]`, the block each request's
        newest token completed (block_table `[bs, >= M + 1]`, seq_lens `[bs]`)."""
        update_summaries(
            k_buffer, summaries, block_table, seq_lens, self.rule.block_size, model_table, gate_table,
            gate.attngate_linear_k.weight, gate.attngate_knorm.weight,
        )

    def scores(
        self, gate: AttnGate, q_post, model_cos_sin, gate_cos_sin, summaries, block_table, num_candidates, max_blocks: int
    ) -> torch.Tensor:
        """Scores `[bs, H_kv, max_blocks]` fp32 (-inf past each row's candidates).

        q_post: `[bs, H_q, D]` after the model's RoPE; model_cos_sin `[bs, D]` / gate_cos_sin
        `[bs, Dg]`: both tables' rows at each query's position; summaries: `[num_pages, H_kv, Dg]`.
        """
        gate_q = gate_query_post_rope(
            q_post, model_cos_sin, gate.attngate_linear_q.weight, gate.attngate_qnorm.weight, gate_cos_sin
        )
        return score_blocks(gate_q, summaries, block_table, num_candidates, self.rule.block_size, max_blocks)

    def pick(self, scores: torch.Tensor, num_candidates: torch.Tensor) -> torch.Tensor:
        """Top-K of `scores` `[bs, H_kv, M]` under the rule: `[bs, H_kv, K]` int32 ascending, -1 padded."""
        r = self.rule
        return select_blocks(scores, num_candidates, r.top_k, r.sink_blocks, r.local_blocks)

    def select(
        self, gate: AttnGate, q_post, model_cos_sin, gate_cos_sin, summaries, block_table, num_candidates, max_blocks: int
    ) -> torch.Tensor:
        """`pick(scores(...))`: selected blocks `[bs, H_kv, K]` int32 (ascending, -1 padded)."""
        scores = self.scores(
            gate, q_post, model_cos_sin, gate_cos_sin, summaries, block_table, num_candidates, max_blocks
        )
        return self.pick(scores, num_candidates)
