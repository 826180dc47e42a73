"""Block scores, the fast torch path for CPU: pages looked up once per step, not per layer."""

from __future__ import annotations

import math

import torch


def score_pages(
    gate_q: torch.Tensor, summaries: torch.Tensor, pages: torch.Tensor, valid: torch.Tensor
) -> torch.Tensor:
    """Scores of the candidate blocks; same result as the reference `score_blocks`.

    gate_q: `[bs, H_kv, Dg]` fp32; summaries: `[num_pages, H_kv, Dg]`; pages: `[bs, M]` physical
    page of each logical block (`score.naive.block_pages`); valid: `[bs, M]` bool (m < candidates).
    Returns `[bs, H_kv, M]` fp32, `-inf` where not valid.
    """
    bs, h_kv, dg = gate_q.shape
    kg = summaries[pages].float()  # [bs, M, H_kv, Dg]
    scores = torch.matmul(kg.permute(0, 2, 1, 3), gate_q.unsqueeze(-1)).squeeze(-1)  # [bs, H_kv, M]
    scores = scores * (1.0 / math.sqrt(dg))
    return scores.masked_fill(~valid[:, None, :], float("-inf"))
