"""Extend attention, the plain statement: new queries against a request's whole prefix + themselves.

The reference the fast path (`torch_path.py`) is tested against: one explicit softmax(q k^T * scale) v per
request in fp32, with the causal rule written out (query i of an extend that starts at position
`prefix_len` sees keys 0 .. prefix_len + i).
"""

from __future__ import annotations

import torch


def extend_attention_naive(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_len: int, scale: float
) -> torch.Tensor:
    """Attention of one request's extend.

    q: `[E, H_q, D]` the new tokens' queries; k, v: `[P + E, H_kv, D]` the request's keys and values
    in position order (prefix first, then the new tokens); prefix_len: P. H_q a multiple of H_kv
    (query head h reads kv head h // (H_q / H_kv)). Returns `[E, H_q, D]` in q's dtype.
    """
    e, h_q, _ = q.shape
    total, h_kv, _ = k.shape
    if total != prefix_len + e:
        raise ValueError(f"k holds {total} tokens, expected prefix {prefix_len} + extend {e}")
    group = h_q // h_kv
    kf = k.float().repeat_interleave(group, dim=1)  # [P+E, H_q, D]
    vf = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("ehd,thd->het", q.float(), kf) * scale  # [H_q, E, P+E]
    allowed = torch.arange(total)[None, :] <= prefix_len + torch.arange(e)[:, None]  # [E, P+E]
    scores = scores.masked_fill(~allowed, float("-inf"))
    out = torch.einsum("het,thd->ehd", scores.softmax(dim=-1), vf)
    return out.to(q.dtype)
