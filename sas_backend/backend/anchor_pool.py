"""Prompt anchors per request row (`--sas-prompt-anchors R`): written at each extend, read by every decode step."""

from __future__ import annotations

import torch

from sas_backend.backend.extend_plan import AnchorRows
from sas_backend.ops.anchors import extend_anchors


class AnchorPool:
    """`anchors[layer]`: `[max_reqs, H_kv, R]` int32 per sparse layer, -1 where a row has none: the blocks each
    request's last prompt token attended most (`ops.anchors`), forced into its decode selections."""

    def __init__(self, layer_ids, max_reqs: int, num_kv_heads: int, count: int, device):
        self.count = int(count)
        self.anchors = {lid: torch.full((max_reqs, num_kv_heads, self.count), -1, dtype=torch.int32, device=device)
                        for lid in sorted(layer_ids)}
        self.nbytes = sum(t.numel() * t.element_size() for t in self.anchors.values())

    @staticmethod
    def nbytes_for(num_layers: int, max_reqs: int, num_kv_heads: int, count: int) -> int:
        """Bytes a pool of this shape holds (what `backend.memory` reserves)."""
        return num_layers * max_reqs * num_kv_heads * count * 4

    def __getitem__(self, layer_id: int) -> torch.Tensor:
        return self.anchors[layer_id]

    def write_extend(self, layer_id: int, rows: AnchorRows, q: torch.Tensor, k_buffer: torch.Tensor,
                     req_to_token: torch.Tensor, scale: float, block_size: int, k_scale: float = 1.0) -> None:
        """The anchors of every request of an extend for one layer, in one batched pass (`ops.anchors.
        extend_anchors`: bounded scratch). q: the extend's queries `[tokens, H_q, D]` after RoPE; k_buffer
        `[slots, H_kv, D]` holding the extend's keys; k_scale: the layer's fp8 key scale."""
        self.anchors[layer_id][rows.rows] = extend_anchors(
            q[rows.last], k_buffer, req_to_token, rows.rows, rows.seq_lens, rows.longest, scale, block_size,
            self.count, k_scale=k_scale)
