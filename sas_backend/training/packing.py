"""Packed-sequence bookkeeping shared by the gate scoring, the gated attention reference and the
distill target: sequence bounds from `cu_seqlens`, and where the queries sit when only the
positions >= `query_start` of every sequence are queries (`--train-last`)."""

from __future__ import annotations

from typing import List, Tuple

import torch


def seq_bounds(cu_seqlens: torch.Tensor | List[int]) -> List[Tuple[int, int]]:
    """`[(bos, eos), ...]` of the packed sequences (host ints)."""
    cu = cu_seqlens.tolist() if torch.is_tensor(cu_seqlens) else list(cu_seqlens)
    if not cu or cu[0] != 0 or any(b < a for a, b in zip(cu[:-1], cu[1:])):
        raise ValueError(f"cu_seqlens must start at 0 and be non-decreasing, got {cu[:8]}...")
    return list(zip(cu[:-1], cu[1:]))


def query_bounds(bounds: List[Tuple[int, int]], query_start: int) -> List[Tuple[int, int]]:
    """Packed `[(qbos, qeos), ...]` of the queries at in-sequence positions >= `query_start`
    (query_start 0: the same as `bounds`)."""
    out, at = [], 0
    for bos, eos in bounds:
        n = max(0, eos - bos - query_start)
        out.append((at, at + n))
        at += n
    return out
