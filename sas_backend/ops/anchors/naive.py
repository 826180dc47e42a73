"""Prompt anchors forced into a selection, the plain statement (tests only)."""

from __future__ import annotations

import torch


def force_anchors(scores: torch.Tensor, anchors: torch.Tensor, num_candidates: torch.Tensor) -> torch.Tensor:
    """A copy of `scores` `[bs, H_kv, M]` where each row's anchored blocks (`anchors` `[bs, H_kv, R]`, -1 none)
    that are candidates (index < num_candidates[r]) score +inf, so a pick takes them right after its forced
    blocks."""
    out = scores.clone()
    bs, h_kv, m = scores.shape
    for r in range(bs):
        for h in range(h_kv):
            for a in anchors[r, h].tolist():
                if 0 <= a < min(m, int(num_candidates[r])):
                    out[r, h, a] = float("inf")
    return out
