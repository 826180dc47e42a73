"""Gate scoring for training: block log-gates over previous blocks and the per-query Top-K threshold.

For packed sequences (`cu_seqlens`), per kv head h, query token t (in-sequence position p, own
block c = p // b) and in-sequence block m:

    kg[m]      = AttnGate.summarize(keys of block m, RoPE at m*b)          (complete blocks only)
    qg[t]      = AttnGate.query(q[t], RoPE at p)
    s[h, t, m] = qg[t, h] . kg[m, h] / sqrt(Dg)
    log_g[h, t, :] = log_softmax(s[h, t, :]) over the blocks m < c; -inf for m >= c
    threshold[h, t] = the K-th largest log_g[h, t, m] over m < c; -inf if fewer than K blocks
                      (all are taken); +inf if K == 0 (none is taken)

so the gated attention selects `{m < c : log_g >= threshold}` (exactly K blocks unless gates
tie at the threshold).

Forced blocks (`sink_blocks` S, `local_blocks` W; the serving rule of `ops.topk.select_blocks`):
the blocks m < S and c - W <= m < c are always attended and count inside K, as the server does
with `--sas-sink-blocks/--sas-local-blocks`. They are not scored: log_g is 0 there (gate 1,
unbiased like the own block, as decode attends them without bias), the softmax runs over the
other previous blocks (the candidates), and the threshold is the (K - S - W)-th largest candidate
log_g. Since every log_g of a candidate is <= 0, forced blocks always pass the threshold, so the
gated attention (kernel and reference) needs no change. S + W < K is required.

With `query_start` = s > 0 only the positions s.. of each sequence are queries (the earlier ones
ran dense, as after a dense prefill): q and the outputs are packed over those query tokens, k over
every token. The inputs q/k are detached: the backbone is frozen and the scores only train the
gate; gradients reach the gate parameters through qg and kg.

Memory: `log_g` `[Hkv, T, NB]` fp32 is the only O(T * NB) tensor kept for backward (the gated
attention saves the same tensor). The scores are built and reduced in chunks of `query_chunk`
queries; backward recomputes the softmax from `log_g` chunk by chunk and saves nothing else of
that size (see `BlockLogGate`). Everything else is O(T * Hkv * Dg).
"""

from __future__ import annotations

import dataclasses
import math
from typing import List, Tuple

import torch

from sas_backend.gate.module import AttnGate
from sas_backend.ops.topk.torch_path import forced_mask
from sas_backend.training.packing import query_bounds, seq_bounds

DEFAULT_QUERY_CHUNK = 4096


@dataclasses.dataclass
class GateScores:
    """log_g `[Hkv, T, NB]` fp32 (differentiable in the gate parameters), threshold `[Hkv, T]`
    fp32 (no gradient), top_k, block_size, num_blocks NB = ceil(max_seqlen / block_size)."""

    log_g: torch.Tensor
    threshold: torch.Tensor
    top_k: int
    block_size: int
    num_blocks: int


def num_blocks_for(bounds: List[Tuple[int, int]], block_size: int) -> int:
    """NB = ceil(max_seqlen / block_size), the block axis the gated attention expects."""
    longest = max((e - s for s, e in bounds), default=0)
    return -(-longest // block_size)


def in_sequence_positions(bounds: List[Tuple[int, int]], total: int, device) -> torch.Tensor:
    """`[T]` int64: position of each token inside its own sequence (0 outside every sequence)."""
    pos = torch.zeros(total, dtype=torch.int64, device=device)
    for bos, eos in bounds:
        pos[bos:eos] = torch.arange(eos - bos, device=device)
    return pos


def block_summaries(
    gate: AttnGate,
    k_pre: torch.Tensor,
    bounds: List[Tuple[int, int]],
    block_size: int,
    num_blocks: int,
    gate_table: torch.Tensor,
) -> torch.Tensor:
    """Summaries of every complete block of every sequence, zero-padded.

    k_pre: `[T, Hkv, D]` pre-RoPE keys; gate_table: the gate's `[max_pos, Dg]` RoPE table.
    Returns `[N, NB, Hkv, Dg]` fp32; row (i, m) is block m of sequence i (zeros if incomplete).
    One `AttnGate.summarize` call covers all blocks (RoPE at each block's first position).
    """
    n_seq = len(bounds)
    h_kv, dg = gate.num_kv_heads, gate.gate_dim
    starts, firsts, slots = [], [], []
    for i, (bos, eos) in enumerate(bounds):
        for m in range((eos - bos) // block_size):
            starts.append(bos + m * block_size)
            firsts.append(m * block_size)
            slots.append(i * num_blocks + m)
    out = k_pre.new_zeros(n_seq * num_blocks, h_kv, dg, dtype=torch.float32)
    if starts:
        dev = k_pre.device
        tok = torch.tensor(starts, device=dev)[:, None] + torch.arange(block_size, device=dev)[None, :]
        kg = gate.summarize(k_pre[tok], gate_table[torch.tensor(firsts, device=dev)])  # [NBtot, Hkv, Dg]
        out = out.index_copy(0, torch.tensor(slots, device=dev), kg)  # differentiable in kg
    return out.view(n_seq, num_blocks, h_kv, dg)


def _valid(pos: torch.Tensor, num_blocks: int, block_size: int) -> torch.Tensor:
    """`[C, NB]` bool: block m is strictly before the own block of the query at position pos."""
    m = torch.arange(num_blocks, device=pos.device)
    return m[None, :] < (pos // block_size)[:, None]


def candidate_blocks(pos: torch.Tensor, num_blocks: int, block_size: int, sink_blocks: int,
                     local_blocks: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """`([C, NB], [C, NB])` bool: (blocks the gate ranks, forced blocks) of queries at positions pos;
    both are previous blocks (m < pos // block_size), forced ones as `ops.topk.forced_mask` picks them."""
    valid = _valid(pos, num_blocks, block_size)
    if not (sink_blocks or local_blocks):
        return valid, torch.zeros_like(valid)
    forced = forced_mask(pos // block_size, num_blocks, sink_blocks, local_blocks)
    return valid & ~forced, forced


def _kth_largest(log_g: torch.Tensor, k: int) -> torch.Tensor:
    """`[..., NB]` -> `[...]`: K-th largest entry (-inf entries are the masked blocks, so this is
    -inf when fewer than K are valid); +inf for K == 0 (select nothing)."""
    if k <= 0:
        return log_g.new_full(log_g.shape[:-1], float("inf"))
    if k > log_g.shape[-1]:
        return log_g.new_full(log_g.shape[:-1], float("-inf"))
    return torch.topk(log_g, k, dim=-1, sorted=True).values[..., -1]


def check_forced(top_k: int, sink_blocks: int, local_blocks: int) -> None:
    """Raise ValueError unless the forced blocks leave the gate at least one of the K to choose."""
    if sink_blocks < 0 or local_blocks < 0:
        raise ValueError(f"sink/local blocks must be >= 0, got {sink_blocks}/{local_blocks}")
    if (sink_blocks or local_blocks) and sink_blocks + local_blocks >= top_k:
        raise ValueError(f"sink {sink_blocks} + local {local_blocks} forced blocks leave none of the K = {top_k} "
                         "blocks to the gate: training needs sink + local < K")


def _block_scores(qg: torch.Tensor, kgi: torch.Tensor, inv: float):
    """(scores `[Hkv, C, NB]`, best run `[Hkv, C, NB]` int64 or None) of queries qg `[C, Hkv, Dg]` against one
    sequence's summaries kgi `[Hkv, NB, Dg]`, or its sub-block run summaries `[Hkv, NB, n, Dg]`: a block scores
    its best run (`selection.SelectionRule.sub_blocks`)."""
    if kgi.dim() == 3:
        return torch.einsum("chd,hmd->hcm", qg, kgi) * inv, None
    s, best = torch.einsum("chd,hmnd->hcmn", qg, kgi).max(dim=-1)
    return s * inv, best


class BlockLogGate(torch.autograd.Function):
    """`(qg, kg) -> (log_g, threshold)`, chunked over queries, memory-bounded backward.

    qg `[T, Hkv, Dg]` fp32, kg `[N, NB, Hkv, Dg]` fp32, or `[N, NB, Hkv, n, Dg]`: n sub-block run summaries a
    block, the block scoring its best run (the gradient reaches that run's summary only, as a max does). Saves
    qg, kg and log_g only; backward recomputes p = exp(log_g) per chunk: ds = (g - p * sum_candidates(g)) /
    sqrt(Dg). Forced blocks (sink/local) get log_g 0 and no gradient (see the module docstring).
    """

    @staticmethod
    def forward(ctx, qg, kg, bounds, block_size, top_k, query_chunk, query_start=0, sink_blocks=0, local_blocks=0):
        t, h_kv, dg = qg.shape
        nb = kg.shape[1]
        inv = 1.0 / math.sqrt(dg)
        log_g = qg.new_full((h_kv, t, nb), float("-inf"))
        thr = qg.new_full((h_kv, t), float("-inf"))
        for i, (qbos, qeos) in enumerate(query_bounds(bounds, query_start)):
            kgi = kg[i].transpose(0, 1)  # [Hkv, NB, (n,) Dg]
            for c0 in range(qbos, qeos, query_chunk):
                c1 = min(qeos, c0 + query_chunk)
                pos = torch.arange(c0 - qbos, c1 - qbos, device=qg.device) + query_start
                cand, forced = candidate_blocks(pos, nb, block_size, sink_blocks, local_blocks)
                s, _ = _block_scores(qg[c0:c1], kgi, inv)
                s = s.masked_fill(~cand, float("-inf"))
                lg = s - torch.logsumexp(s, dim=-1, keepdim=True)
                lg = lg.masked_fill(~cand, float("-inf"))  # also rows with no candidate (nan)
                thr[:, c0:c1] = _kth_largest(lg, top_k - sink_blocks - local_blocks)
                log_g[:, c0:c1] = lg.masked_fill(forced, 0.0)
        ctx.save_for_backward(qg, kg, log_g)
        ctx.bounds, ctx.block_size, ctx.query_chunk = bounds, block_size, query_chunk
        ctx.query_start, ctx.forced = query_start, (sink_blocks, local_blocks)
        ctx.mark_non_differentiable(thr)
        return log_g, thr

    @staticmethod
    def backward(ctx, grad_log_g, _grad_thr):
        qg, kg, log_g = ctx.saved_tensors
        nb = kg.shape[1]
        inv = 1.0 / math.sqrt(qg.shape[-1])
        dqg = torch.zeros_like(qg)
        dkg = torch.zeros_like(kg)
        if grad_log_g is None:
            return dqg, dkg, None, None, None, None, None, None, None
        for i, (qbos, qeos) in enumerate(query_bounds(ctx.bounds, ctx.query_start)):
            kgi = kg[i].transpose(0, 1)  # [Hkv, NB, (n,) Dg]
            for c0 in range(qbos, qeos, ctx.query_chunk):
                c1 = min(qeos, c0 + ctx.query_chunk)
                pos = torch.arange(c0 - qbos, c1 - qbos, device=qg.device) + ctx.query_start
                cand, _ = candidate_blocks(pos, nb, ctx.block_size, *ctx.forced)
                g = grad_log_g[:, c0:c1].float().masked_fill(~cand, 0.0)  # masked/forced entries are constants
                p = log_g[:, c0:c1].exp().masked_fill(~cand, 0.0)  # forced entries hold exp(0)
                ds = (g - p * g.sum(dim=-1, keepdim=True)) * inv  # [Hkv, C, NB]
                if kgi.dim() == 3:
                    dqg[c0:c1] = torch.einsum("hcm,hmd->chd", ds, kgi)
                    dkg[i] += torch.einsum("hcm,chd->mhd", ds, qg[c0:c1])
                    continue
                _, best = _block_scores(qg[c0:c1], kgi, inv)  # each block's best run, recomputed
                dsn = ds.new_zeros(*ds.shape, kgi.shape[2]).scatter_(-1, best[..., None], ds[..., None])
                dqg[c0:c1] = torch.einsum("hcmn,hmnd->chd", dsn, kgi)
                dkg[i] += torch.einsum("hcmn,chd->mhnd", dsn, qg[c0:c1])
        return dqg, dkg, None, None, None, None, None, None, None


def score_gate(gate: AttnGate, q_pre: torch.Tensor, k_pre: torch.Tensor, cu_seqlens: torch.Tensor | List[int],
               block_size: int, top_k: int, gate_table: torch.Tensor, *, query_chunk: int = DEFAULT_QUERY_CHUNK,
               query_start: int = 0, sink_blocks: int = 0, local_blocks: int = 0) -> GateScores:
    """Block log-gates and Top-K thresholds of one layer for packed sequences.

    q_pre: `[Tq, Hq, D]`, k_pre: `[T, Hkv, D]` pre-RoPE (after the model's q/k norm), detached here.
    query_start: the queries are the in-sequence positions >= query_start of every sequence
    (packed, Tq = sum(max(0, len - query_start))); 0: every token (Tq = T).
    log_g `[Hkv, Tq, NB]` and threshold `[Hkv, Tq]` are packed over the queries.
    cu_seqlens: `[N+1]`; top_k: K previous blocks per query (budget // block_size, the serving rule);
    gate_table: the gate's `[max_pos, Dg]` RoPE table (positions are in-sequence).
    sink_blocks/local_blocks: forced blocks inside K (module docstring), sink + local < top_k.
    Runs in fp32 whatever the autocast state (the gate was designed for fp32 scoring).
    """
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0, got {top_k}")
    if query_chunk < 1:
        raise ValueError(f"query_chunk must be >= 1, got {query_chunk}")
    if query_start < 0:
        raise ValueError(f"query_start must be >= 0, got {query_start}")
    check_forced(top_k, sink_blocks, local_blocks)
    bounds = seq_bounds(cu_seqlens)
    t = k_pre.shape[0]
    qb = query_bounds(bounds, query_start)
    t_q = t if query_start == 0 else (qb[-1][1] if qb else 0)  # tokens after the last sequence: no blocks
    if q_pre.shape[0] != t_q or (bounds and bounds[-1][1] > t):
        raise ValueError(f"q has {q_pre.shape[0]} tokens (expected {t_q} queries from position {query_start}), "
                         f"k has {t}, cu_seqlens ends at {bounds[-1][1] if bounds else 0}")
    longest = max((e - s for s, e in bounds), default=0)
    if longest > gate_table.shape[0]:
        raise ValueError(f"a sequence of {longest} tokens exceeds the gate RoPE table "
                         f"({gate_table.shape[0]} positions)")
    nb = num_blocks_for(bounds, block_size)
    q_pre, k_pre = q_pre.detach(), k_pre.detach()  # frozen backbone: scores train the gate only
    with torch.autocast(q_pre.device.type, enabled=False):
        kg = block_summaries(gate, k_pre, bounds, block_size, nb, gate_table)
    return score_with_summaries(gate, q_pre, kg, bounds, block_size, top_k, gate_table, query_chunk=query_chunk,
                                query_start=query_start, sink_blocks=sink_blocks, local_blocks=local_blocks)


def score_with_summaries(gate: AttnGate, q_pre: torch.Tensor, kg: torch.Tensor, bounds: List[Tuple[int, int]],
                         block_size: int, top_k: int, gate_table: torch.Tensor, *,
                         query_chunk: int = DEFAULT_QUERY_CHUNK, query_start: int = 0, sink_blocks: int = 0,
                         local_blocks: int = 0) -> GateScores:
    """`score_gate` from block summaries already made: kg `[N, NB, Hkv, Dg]` (zeros for incomplete
    blocks, as `block_summaries` pads), q_pre `[Tq, Hq, D]` packed over the queries of `bounds`
    (positions >= query_start). The entry point of training on cached features, whose summaries
    come from pooled keys (`AttnGate.summarize_pooled`)."""
    q_pre = q_pre.detach()
    with torch.autocast(q_pre.device.type, enabled=False):
        pos = in_sequence_positions(query_bounds(bounds, query_start), q_pre.shape[0], q_pre.device) + query_start
        qg = gate.query(q_pre, gate_table[pos])  # [Tq, Hkv, Dg]
        log_g, thr = BlockLogGate.apply(qg, kg, bounds, block_size, top_k, query_chunk, query_start,
                                        sink_blocks, local_blocks)
    return GateScores(log_g=log_g, threshold=thr, top_k=top_k, block_size=block_size, num_blocks=kg.shape[1])
