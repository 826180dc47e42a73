"""Extend (prefill) attention over SGLang's paged KV cache, for CPU: ONE entry point.

    paged_extend_attention(q, out, k_cache, v_cache, req_to_token, req_pool_indices,
                           prefix_lens, extend_lens, scale)

`torch_path.extend_attention_torch` is the fast path (the new queries only, in position-aligned blocks merged
by log-sum-exp, bit-identical however the extend is chunked; a masked fallback);
`naive.extend_attention_naive` is the plain statement and the tests' oracle. Used by the `sas`
backend for extend on CPU in place of SGLang's torch-native extend (torch_path.py says why).
"""

from __future__ import annotations

from typing import Sequence

import torch

from sas_backend.ops import FP8_DTYPES
from sas_backend.ops.extend.torch_path import DEFAULT_METHOD, MAX_MASK_ELEMS, METHODS, extend_attention_torch


def paged_extend_attention(
    q: torch.Tensor,
    out: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: Sequence[int],
    prefix_lens: Sequence[int],
    extend_lens: Sequence[int],
    scale: float,
    max_mask_elems: int = MAX_MASK_ELEMS,
    method: str = DEFAULT_METHOD,
    block: int = 64,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Causal attention of a batch of extends, each request's new tokens against its cached prefix.

    q: `[sum(E), H_q, D]` the new tokens, request after request; out: `[sum(E), H_q, D_v]` written
    in place and returned. k_cache, v_cache: `[slots, H_kv, D]` one layer of the KV pool, the new
    tokens' K/V already stored (fp8: K / k_scale and V / v_scale, the layer's scales; each request's rows are
    dequantized into q's dtype). req_to_token: `[max_reqs, max_context]` slot of each (request row,
    position). req_pool_indices, prefix_lens (P), extend_lens (E): per request, host ints. method,
    block (the KV page), max_mask_elems: see `torch_path.extend_attention_torch`. A decode step is an
    extend of one token a request (P = seq_len - 1, E = 1): exact dense decode attention.
    """
    quantized = k_cache.dtype in FP8_DTYPES or k_scale != 1.0 or v_scale != 1.0
    start = 0
    for row, p, e in zip(req_pool_indices, prefix_lens, extend_lens):
        row, p, e = int(row), int(p), int(e)
        if e == 0:
            continue
        slots = req_to_token[row, : p + e].long()
        k, v = k_cache[slots], v_cache[slots]
        if quantized:
            k, v = (k.float() * k_scale).to(q.dtype), (v.float() * v_scale).to(q.dtype)
        extend_attention_torch(
            q[start : start + e], k, v, p, scale, max_mask_elems,
            out=out[start : start + e], method=method, block=block,
        )
        start += e
    return out


__all__ = [
    "paged_extend_attention", "extend_attention_torch", "DEFAULT_METHOD", "MAX_MASK_ELEMS", "METHODS",
]
