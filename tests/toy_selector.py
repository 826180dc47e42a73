"""A selector registered from outside sas_backend, the worked example of docs/development.md ("Adding a
selector"): `--sas-selector-module tests.toy_selector --sas-selector toy-recency` serves it with no other file
changed (tests/server/test_selector_plugin.py).

toy-recency keeps one number per page and kv head, the position of the block's first token, and ranks the
newest complete blocks first: with one forced sink block it selects exactly what sink-local does (block 0 and
the K - 1 blocks before the current one), which the server test checks against the independent oracle's
sink-local rule. Its state is written at extend (`summarize`) and at decode (`update`) and read per page
through the block table, so a page whose summary was never written would be ranked by a stale number.
"""

from __future__ import annotations

import torch

from sas_backend.selection import Selector, register_selector


@register_selector
class RecencySelector(Selector):
    """Scores each candidate block by its first token's position (newest first)."""

    name = "toy-recency"
    help = "test toy: the newest blocks first"

    def __init__(self, rule):
        if rule.sub_blocks != 1:
            raise ValueError("toy-recency keeps one summary a block (--sas-sub-blocks 1)")
        super().__init__(rule)

    def summary_dim(self, head_dim: int, gate_dim: int) -> int:
        return 1

    def summarize(self, gate, k_buffer, pages, starts, model_table, gate_table, k_scale=1.0) -> torch.Tensor:
        """`[N, H_kv, 1]` the blocks' first positions (the page holds its block's position, not its slot)."""
        return starts.to(torch.float32)[:, None, None].expand(-1, k_buffer.shape[1], 1).contiguous()

    def update(self, gate, k_buffer, summaries, block_table, seq_lens, model_table, gate_table, k_scale=1.0) -> None:
        self._update_masked(gate, k_buffer, summaries, block_table, seq_lens, model_table, gate_table, k_scale)

    def scores(self, gate, q_post, model_cos_sin, gate_cos_sin, summaries, block_table, num_candidates, max_blocks):
        pages = torch.div(block_table[:, :max_blocks].long(), self.rule.block_size, rounding_mode="floor")
        position = summaries[pages][..., 0].float().transpose(1, 2)  # [bs, H_kv, M]
        live = torch.arange(max_blocks, device=position.device) < num_candidates.long()[:, None, None]
        return torch.where(live, position, torch.full_like(position, float("-inf")))
