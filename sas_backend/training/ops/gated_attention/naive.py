"""Gated sparse-scope attention, materialized in plain torch (the test oracle).

Per query token t (in-sequence position p, own block c = p // b) and kv head h the attended set is
its own block, causal and unbiased (gate 1), plus every previous block m < c whose log-gate
`log_g[h, t, m]` is >= `threshold[h, t]`, all of its b keys, biased by that log-gate:

    out[t, qh] = softmax_S(q[t, qh] . k[S, h] * scale + bias_S) @ v[S, h],   h = qh // G.

Everything is differentiable by autograd in q, k, v and log_g (the selection itself is a step
function of log_g, so its derivative is the bias path only). Memory is O(Hq * L^2) per sequence.
"""

from __future__ import annotations

import math

import torch

from sas_backend.training.packing import query_bounds, seq_bounds


def _block_bias(
    log_g: torch.Tensor, threshold: torch.Tensor, seqlen: int, block_size: int, query_start: int = 0
) -> torch.Tensor:
    """Additive logit bias of one sequence whose queries are the positions query_start.. .

    log_g: `[Hkv, Lq, NB]`; threshold: `[Hkv, Lq]` (Lq = seqlen - query_start). Returns
    `[Hkv, Lq, L]`: 0 on the causal own block, log_g on the keys of selected previous blocks,
    -inf elsewhere.
    """
    n_q = seqlen - query_start
    pos = torch.arange(seqlen, device=log_g.device)
    qpos = pos[query_start:]
    blk, qblk = pos // block_size, qpos // block_size
    # bias of key j for query t is log_g[h, t, block(j)]: gather along the block axis
    idx = blk.view(1, 1, seqlen).expand(log_g.shape[0], n_q, seqlen)
    lg_keys = torch.gather(log_g, 2, idx)  # [Hkv, Lq, L]
    own = (blk[None, :] == qblk[:, None]) & (pos[None, :] <= qpos[:, None])  # [Lq, L]
    prev = (blk[None, :] < qblk[:, None])[None] & (lg_keys >= threshold[..., None])
    neg_inf = lg_keys.new_full((), float("-inf"))
    # torch.where routes gradient only to the selected entries, zero elsewhere
    biased = torch.where(prev, lg_keys, neg_inf)
    return torch.where(own[None], torch.zeros_like(biased), biased)


def gated_attention_naive(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_g: torch.Tensor,
    threshold: torch.Tensor,
    cu_seqlens: torch.Tensor,
    block_size: int,
    scale: float | None = None,
    query_start: int = 0,
) -> torch.Tensor:
    """Gated sparse-scope attention over packed variable-length sequences (materialized).

    q: `[T, Hq, D]`; k, v: `[T, Hkv, D]`; log_g: `[Hkv, T, NB]` (NB = ceil(max_seqlen / block_size),
    only entries of blocks before the query's own block are read); threshold: `[Hkv, T]`;
    cu_seqlens: `[N+1]` int (sequence i = tokens cu_seqlens[i] .. cu_seqlens[i+1]-1).
    Returns `[T, Hq, D]` in q's dtype. Computes in float64 for float64 inputs, else float32.
    Any block_size >= 1 is supported.

    query_start > 0: only the in-sequence positions >= query_start of every sequence are queries
    (the earlier tokens are keys only, as after a dense prefill); q, log_g, threshold and the output
    are then packed over those Tq = sum(max(0, len - query_start)) query tokens, k/v over all T.
    """
    t_total, h_q, d = k.shape[0], q.shape[1], q.shape[2]
    h_kv = k.shape[1]
    if h_q % h_kv:
        raise ValueError(f"Hq={h_q} is not a multiple of Hkv={h_kv}")
    group = h_q // h_kv
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    bounds = seq_bounds(cu_seqlens)
    qb = query_bounds(bounds, query_start)
    t_q = t_total if query_start == 0 else (qb[-1][1] if qb else 0)
    if q.shape[0] != t_q:
        raise ValueError(f"q has {q.shape[0]} tokens, expected {t_q} (queries at positions >= {query_start})")
    outs = []
    for (bos, eos), (qbos, qeos) in zip(bounds, qb):
        if qeos == qbos:
            continue
        n = eos - bos
        qs = q[qbos:qeos].to(acc).transpose(0, 1)  # [Hq, Lq, D]
        ks = k[bos:eos].to(acc).transpose(0, 1).repeat_interleave(group, 0)  # [Hq, L, D]
        vs = v[bos:eos].to(acc).transpose(0, 1).repeat_interleave(group, 0)
        bias = _block_bias(
            log_g[:, qbos:qeos].to(acc), threshold[:, qbos:qeos].to(acc), n, block_size, query_start
        )  # [Hkv, Lq, L]
        s = qs @ ks.transpose(1, 2) * scale + bias.repeat_interleave(group, 0)
        o = torch.softmax(s, dim=-1) @ vs  # [Hq, Lq, D]
        outs.append(o.transpose(0, 1))
    end = bounds[-1][1] if bounds else 0
    if query_start == 0 and end < t_total:  # tokens after the last sequence: not attended, zero output
        outs.append(q.new_zeros(t_total - end, h_q, d, dtype=acc))
    if not outs:
        return q.new_zeros(t_q, h_q, d)
    return torch.cat(outs, 0).to(q.dtype)
