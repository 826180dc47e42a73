"""The fused decode step stated with the ops' plain references (the kernels' test oracle only).

    front  = ops.gate.naive.gate_query_post_rope  +  ops.summary.naive.summary_update_decode
    select = ops.score.naive.score_blocks -> ops.anchors.naive.force_anchors -> ops.topk.naive.select_blocks
    attend = ops.sparse_decode.naive.sparse_decode_attention over ops.gather.naive's token rows
"""

from __future__ import annotations

from typing import Optional

import torch

from sas_backend.ops.anchors.naive import force_anchors
from sas_backend.ops.gate.naive import gate_query_post_rope
from sas_backend.ops.gather.naive import build_kv_indices
from sas_backend.ops.score.naive import score_blocks
from sas_backend.ops.sparse_decode.naive import sparse_decode_attention
from sas_backend.ops.summary.naive import summary_update_decode
from sas_backend.ops.topk.naive import select_blocks


def front(q, model_cos_sin, gate_cos_sin, w_q, q_norm, k_buffer, model_table, gate_table, w_k, k_norm, summaries,
          block_table, seq_lens, block_size, sub_blocks: int = 1, k_scale: float = 1.0) -> torch.Tensor:
    """Gate query `[bs, H_kv, Dg]` fp32; summaries `[num_pages, H_kv, sub_blocks * Dg]` updated in place (shapes as
    `ops.fused_step.front`; the keys summarized are the stored ones times k_scale, in fp32)."""
    summary_update_decode(k_buffer, summaries, block_table, seq_lens, block_size, model_table, gate_table,
                          w_k.float(), k_norm.float(), sub_blocks, k_scale)
    return gate_query_post_rope(q, model_cos_sin, w_q.float(), q_norm.float(), gate_cos_sin)


def scores(gate_q, summaries, block_table, num_candidates, block_size, max_blocks,
           anchors: Optional[torch.Tensor] = None, sub_blocks: int = 1) -> torch.Tensor:
    """`[bs, H_kv, max_blocks]` fp32 scores (a block's best of its sub_blocks runs) with anchored candidates
    raised to +inf."""
    s = score_blocks(gate_q, summaries.float(), block_table, num_candidates, block_size, max_blocks, sub_blocks)
    return s if anchors is None else force_anchors(s, anchors, num_candidates)


def select(gate_q, summaries, block_table, num_candidates, block_size, max_blocks, top_k, sink_blocks=0,
           local_blocks=0, anchors=None, sub_blocks: int = 1) -> torch.Tensor:
    """`[bs, H_kv, K]` int32 ascending, -1 padded (as `ops.fused_step.select`)."""
    s = scores(gate_q, summaries, block_table, num_candidates, block_size, max_blocks, anchors, sub_blocks)
    return select_blocks(s, num_candidates, top_k, sink_blocks, local_blocks)


def attend(q, k_buffer, v_buffer, selected, block_table, seq_lens, block_size, scale, k_scale: float = 1.0,
           v_scale: float = 1.0) -> torch.Tensor:
    """`[bs, H_q, Dv]` in q's dtype (as `ops.fused_step.attend`; K and V the stored ones times their scales)."""
    indptr, indices = build_kv_indices(selected.cpu(), block_table.cpu(), seq_lens.cpu(), block_size)
    return sparse_decode_attention(q, k_buffer, v_buffer, indptr.to(q.device), indices.to(q.device), scale,
                                   k_scale, v_scale)
