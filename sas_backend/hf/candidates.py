"""Candidate selectors for long context, evaluation only: block scores that keep needle-like signals.

Today's gate scores a block by one dot product with a pooled (max / min / mean) summary of its 64 keys; the
SAS paper blames exactly that pooling for losing needles at long context. The candidates here score a block
by a MAX over finer units instead, each a plain statement (`[P, H_kv, M]` scores, -inf past each query's
candidates, the same shape `SparseEvalSpec` selectors return) that `hf.sparse_eval` runs in place of a
server selector:

- `exactmax`: max over the block's tokens and the kv group's query heads of the exact post-RoPE q.k. It
  reads every key (half of dense attention's bytes), so it is not servable: the ceiling of the per-token
  family below, and a check of what a per-token max can reach at all.
- `pairs<R>`: the same max over R of the D/2 RoPE channel pairs (dims i and i + D/2), chosen per layer and
  kv head by their calibrated magnitude (`calibrate_pairs`). A pair's partial dot product is exactly its
  share of q.k at any position (RoPE rotates within the pair), so it needs no new weights: a static
  SparQ. Per token it keeps 2R values: R = D/32 reads 1/16 of dense's bytes at the same dtype.
- `pca<R>`: the same max over a LEARNED R-dim projection per layer and kv head (Loki's low-rank keys, fitted to
  the queries): score = (Pq q).(Pk k) with Pq = V^T W^-1, Pk = V^T W, W = E[q q^T]^(1/2) over the group's
  post-RoPE queries and V the R leading eigenvectors of the weighted keys' covariance W Cov(k) W. That is
  the rank-R map keeping most of the variance of q.k over keys for queries of the calibration's second
  moments (a key's mean adds the same to every key's score, so it is left out). Fitted once from a dense
  forward of calibration text (`calibrate_model_pca`), no training. Per token R values a kv head: R = D/8 in bf16
  or D/4 in fp8 reads 1/16 of dense's bf16 K + V.
- `keys<R>` / `keys<R>mass`: `pca<R>`'s projection TRAINED per layer to rank blocks by mass as the dense
  attention does (`hf.learned_keys`): a learned per-token index key, from a file of fitted projections.
- `gatec<X>exact` / `gatesub<S>c<X>exact`: two levels, the second exact, as the server runs them
  (`--sas-exact-rerank X`; with `sub<S>` over `--sas-sub-blocks b / S`): the gate (with the spec's summaries a
  block, or b / S of them) picks X x K blocks per query and kv head (forced blocks and anchors in), and
  `ops.rerank.rerank_blocks` keeps the K of highest exact mass among those blocks alone (`hf.sparse_eval` calls the
  served op): a step reads one summary a block plus the K half of X x K blocks (X / 2 times what the sparse
  attention itself reads), bounded by the budget, not the context.
- `exactmass` / `pca<R>mass`: the same per-token scores combined as the oracle combines them, a block by its
  softmax mass (log-sum-exp over its tokens, each query head normalized over the candidates), not its best
  token. `exactmass` is the oracle up to the normalization (candidates only); it shows how much of a gap to the
  oracle is the combining rule, `exactmax` against it, and how much the scores.
- `gatesub<S>` / `questsub<S>`: the server's gate / quest selector with sub-block summaries
  (`SelectionRule.sub_blocks` = b / S): each S-token run of a block summarized as a block of its own (the
  gate's max / min / mean pooling over S keys, RoPE at the run's start; quest's min / max), the block scored
  by its best run. b / S summaries a page: at S = 16 the gate keeps 4 x Dg values, in bf16 1/16 of a 64-token
  page's bf16 K + V at D = 64, Dg = 128 (1/32 at D = 128).
- `gatesub<S>c<X>`: two levels. The gate with ONE summary a block ranks every candidate block and keeps its
  best X x K (K = top_k) per query and kv head; `gatesub<S>` ranks only those. What it would read a step: one
  summary a block plus b / S of each of the X x K kept blocks, so its bytes stay near the one-summary gate's at
  long context, where `gatesub<S>`'s grow b / S fold.
"""

from __future__ import annotations

import re
from typing import Dict, Optional

import torch

from sas_backend.hf.causal import causal_sdpa

CANDIDATE_PATTERN = re.compile(
    r"^(exactmax|exactmass|pairs(\d+)|(gate|quest)sub(\d+)(?:c(\d+))?|(pca|keys)(\d+)(mass)?)$")
# Two levels with an exact second: the gate (its summaries a block as the spec says, or b / S of them with sub<S>)
# keeps X x K blocks, exactmass ranks only those.
# `q<bits>` (a screen, not served): the second level reads keys quantized per block and channel (`quantize_keys`).
# `group` instead of `exact` (a screen, not served): the second level chooses inside fixed groups of X first-level
# candidates (`grouped_second_level`), a rule an attend launch can apply split by split with no global top-K.
# `tier` (the same, groups formed without sorting: `tier_groups`).
# `s<bits>` last (a screen, not served): the gate's summaries stored at that many bits (`quantize_summaries`).
GATE_EXACT_PATTERN = re.compile(r"^gate(?:sub(\d+))?c(\d+)(exact|group|tier)(?:q(\d+))?(?:s(\d+))?$")


def is_candidate(name: str) -> bool:
    """Whether `name` names a candidate selector (`exactmax`, `exactmass`, `pairs<R>`, `pca<R>`, `pca<R>mass`,
    `keys<R>`, `keys<R>mass`, `gatesub<S>`, `questsub<S>`, `gatesub<S>c<X>`, `gatec<X>exact`,
    `gatesub<S>c<X>exact`, `group` for `exact`, and `q<bits>` then `s<bits>` after either)."""
    return bool(CANDIDATE_PATTERN.match(name) or GATE_EXACT_PATTERN.match(name))


def gate_exact_factor(name: str) -> Optional[int]:
    """X of `gatec<X>exact` / `gatesub<S>c<X>exact` (the gate keeps X x K blocks, exactmass ranks them), else
    None."""
    match = GATE_EXACT_PATTERN.match(name)
    if match is None:
        return None
    if int(match.group(2)) < 1:
        raise ValueError(f"{name}: the first level must keep at least K blocks (X >= 1)")
    return int(match.group(2))


def _bits(name: str, group: int, what: str) -> Optional[int]:
    """The bit count in GATE_EXACT_PATTERN's `group` of `name` (1-8), else None."""
    match = GATE_EXACT_PATTERN.match(name)
    if match is None or match.group(group) is None:
        return None
    bits = int(match.group(group))
    if not 1 <= bits <= 8:
        raise ValueError(f"{name}: {what} bits must be 1-8")
    return bits


def rerank_key_bits(name: str) -> Optional[int]:
    """`bits` of `gate...c<X>exactq<bits>` (the second level reads `quantize_keys(k, bits)`), else None."""
    return _bits(name, 4, "key")


def summary_bits(name: str) -> Optional[int]:
    """`bits` of `gate...c<X>exact[q<b>]s<bits>` (the gate scores `quantize_summaries(summaries, bits)`), else
    None."""
    return _bits(name, 5, "summary")


def is_grouped(name: str) -> bool:
    """Whether `name` is `gate...c<X>group...` or `gate...c<X>tier...` (`grouped_second_level`)."""
    match = GATE_EXACT_PATTERN.match(name)
    return match is not None and match.group(3) in ("group", "tier")


def grouping(name: str) -> str:
    """`snake` for `gate...c<X>group...`, `tier` for `gate...c<X>tier...`."""
    return "tier" if GATE_EXACT_PATTERN.match(name).group(3) == "tier" else "snake"


def snake_groups(rank: torch.Tensor, groups: torch.Tensor, factor: int) -> torch.Tensor:
    """Group of each first-level rank (0 = best non-forced candidate): ranks laid out in `factor` rows of
    `groups` back and forth (0..n-1, then n-1..0, ...), so the best candidate shares its group with the worst
    one and the middle ones meet each other; -1 past factor x groups. rank, groups: broadcastable int64."""
    n = groups.clamp_min(1)
    row, col = torch.div(rank, n, rounding_mode="floor"), rank % n
    group = torch.where(row % 2 == 0, col, n - 1 - col)
    return torch.where((rank < factor * groups) & (groups > 0), group, -1)


def tier_groups(rank: torch.Tensor, groups: torch.Tensor, factor: int, valid: torch.Tensor) -> torch.Tensor:
    """Group of each candidate without a sort: tier = rank // groups (what a radix select's X thresholds give),
    and inside a tier the i-th candidate in block order (the order `first` holds them) joins group i; -1 past
    `factor` tiers. rank `[..., C]` (>= C where not `valid`), groups `[..., 1]`."""
    n = groups.clamp_min(1)
    tier = torch.div(rank, n, rounding_mode="floor")
    group = torch.full_like(rank, -1)
    for t in range(factor):
        member = valid & (tier == t)
        group = torch.where(member, member.long().cumsum(-1) - 1, group)
    return torch.where((group >= 0) & (groups > 0), group, -1)


def grouped_second_level(first: torch.Tensor, first_scores: torch.Tensor, lse: torch.Tensor,
                         num_candidates: torch.Tensor, k: int, factor: int, sink_blocks: int, local_blocks: int,
                         anchors: Optional[torch.Tensor] = None, rule: str = "snake") -> torch.Tensor:
    """`[P, H_kv, C]` bool: which of the first level's blocks `first` `[P, H_kv, C]` (-1 padded) the grouped
    second level keeps. Forced blocks (sink / local of `num_candidates` `[P]`, anchors `[P, H_kv, R]`) are kept;
    the other candidates, ranked by `first_scores` `[P, H_kv, C]`, fill `snake_groups` of `factor`, one group per
    place left in K, and each group keeps its block of highest mass among the group's own blocks (max over the
    kv group's query heads of `lse` `[P, H_kv, G, C]`, a block's log-sum-exp of logits, normalized inside the
    group): the second level needs no top-K across groups. rule: `snake` (`snake_groups`) or `tier`
    (`tier_groups`)."""
    p, h, c = first.shape
    valid = first >= 0
    n = num_candidates.view(p, 1, 1)
    forced = valid & ((first < sink_blocks) | (first >= n - local_blocks))
    if anchors is not None:
        forced |= valid & (first[..., :, None] == anchors[..., None, :]).any(-1)
    groups = (k - forced.sum(-1, keepdim=True)).clamp_min(0)  # [P, H_kv, 1]
    key = first_scores.masked_fill(~valid | forced, float("-inf"))
    order = key.argsort(dim=-1, descending=True, stable=True)
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(c).expand_as(order))
    free = valid & ~forced
    if rule == "tier":
        group = tier_groups(rank, groups, factor, free)
    else:
        group = snake_groups(rank, groups, factor)
    group = group.masked_fill(~free, -1)  # [P, H_kv, C]
    at = torch.where(group >= 0, group, k)[:, :, None, :].expand_as(lse)  # k: a bin for the dropped
    peak = torch.full(lse.shape[:-1] + (k + 1,), float("-inf")).scatter_reduce(-1, at, lse, "amax")
    shifted = torch.exp(lse - torch.gather(peak, -1, at).nan_to_num(neginf=0.0))
    total = torch.zeros(peak.shape).scatter_add_(-1, at, shifted.nan_to_num(0.0))
    share = (lse - torch.gather(peak, -1, at) - torch.log(torch.gather(total, -1, at))).amax(dim=2)  # [P,H_kv,C]
    share = share.masked_fill(group < 0, float("-inf"))
    # Per group the first block of highest share (ties to the lower position in `first`, ascending by block).
    best = torch.full((p, h, k + 1), float("-inf")).scatter_reduce(-1, torch.where(group >= 0, group, k), share,
                                                                 "amax")
    top = (share == torch.gather(best, -1, torch.where(group >= 0, group, k))) & (group >= 0)
    return forced | _first_per_group(top, group, k)


def _first_per_group(top: torch.Tensor, group: torch.Tensor, k: int) -> torch.Tensor:
    """`top` with only the lowest position of each group kept (the tie rule)."""
    c = top.shape[-1]
    pos = torch.arange(c).expand_as(group)
    bins = torch.where(top & (group >= 0), group, k)
    lowest = torch.full(group.shape[:-1] + (k + 1,), c).scatter_reduce(-1, bins, torch.where(top, pos, c), "amin")
    return top & (torch.gather(lowest, -1, bins) == pos)


def quantize_keys(keys: torch.Tensor, bits: int, block_size: int) -> torch.Tensor:
    """`keys` `[T, H_kv, D]` rounded to `bits` bits per value, asymmetric per (block of `block_size` tokens,
    kv head, channel): each block stores its channel's min and step (KIVI's per-channel key grouping), so a
    block of b tokens costs b x D x bits / 8 bytes plus 2 x D scales. Returned dequantized, same shape and
    dtype (fp32 arithmetic). Partial last block: its own range."""
    t = keys.shape[0]
    pad = (-t) % block_size
    x = torch.nn.functional.pad(keys.float(), (0, 0, 0, 0, 0, pad))
    x = x.view(-1, block_size, *keys.shape[1:])  # [NB, b, H_kv, D]
    valid = (torch.arange(x.shape[0] * block_size) < t).view(-1, block_size, 1, 1)
    lo = x.masked_fill(~valid, float("inf")).amin(dim=1, keepdim=True)
    hi = x.masked_fill(~valid, float("-inf")).amax(dim=1, keepdim=True)
    levels = 2 ** bits - 1
    step = ((hi - lo) / levels).clamp_min(1e-8)
    q = ((x - lo) / step).round().clamp(0, levels)
    return (q * step + lo).view(-1, *keys.shape[1:])[:t].to(keys.dtype)


def quantize_summaries(summaries: torch.Tensor, bits: int, width: int) -> torch.Tensor:
    """`summaries` `[NB, H_kv, S]` (S = runs x `width`, each run's summary `width` wide) rounded to `bits` bits per
    value, asymmetric per run summary: each stores its min and step, rounded to fp16 as a pool would keep them, so a
    summary of Dg values costs Dg x bits / 8 + 4 bytes (4 bits, Dg 128: 0.53 bytes a value against bf16's 2).
    Returned dequantized, fp32, same shape."""
    nb, h, s = summaries.shape
    x = summaries.float().reshape(nb, h, s // width, width)
    lo = x.amin(dim=-1, keepdim=True).half().float()
    levels = 2 ** bits - 1
    step = ((x.amax(dim=-1, keepdim=True) - lo) / levels).half().float()
    codes = torch.where(step > 0, torch.floor((x - lo) / step.clamp_min(1e-30) + 0.5), torch.zeros_like(x))
    return (lo + step * codes.clamp(0, levels)).reshape(nb, h, s)


def candidate_mask(positions: torch.Tensor, width: int, block_size: int) -> torch.Tensor:
    """`[P, 1, width]` bool: block m is a candidate of the query at positions[p] (complete, before its own)."""
    n_cand = torch.div(positions, block_size, rounding_mode="floor")
    return (torch.arange(width, device=positions.device)[None, :] < n_cand[:, None])[:, None, :]


def token_max_scores(q_post: torch.Tensor, k_post: torch.Tensor, positions: torch.Tensor, block_size: int,
                     dims: Optional[torch.Tensor] = None, proj=None, mass: bool = False) -> torch.Tensor:
    """Scores `[P, H_kv, M]` = max over block m's tokens and the group's query heads of q.k (over `dims` only, or
    of the projected (Pq q).(Pk k)); with `mass`, instead the log of the block's softmax mass under those scores
    (scaled by D^-1/2, normalized per query head over the query's candidate tokens), max over the group's heads:
    the oracle's rule (`ops.anchors.block_mass`) on the candidates' scores.

    q_post: `[P, H_q, D]`, k_post: `[T, H_kv, D]` post-RoPE; positions: `[P]`; dims: optional `[H_kv, R']`
    channel indices per kv head (None: all D); proj: optional (Pq, Pk), each `[H_kv, R, D]` (`fit_pca`).
    M = max(T // b, 1); -inf past each query's candidates.
    """
    p_cnt, h_q, d = q_post.shape
    t, h_kv, _ = k_post.shape
    g = h_q // h_kv
    n_blocks = t // block_size
    m = max(n_blocks, 1)
    q = q_post.float().view(p_cnt, h_kv, g, d)
    k = k_post[: n_blocks * block_size].float()  # [T', H_kv, D]
    if dims is not None:
        q = torch.gather(q, 3, dims[None, :, None, :].expand(p_cnt, h_kv, g, -1))
        k = torch.gather(k, 2, dims[None].expand(k.shape[0], -1, -1))
    if proj is not None:
        pq, pk = (x.float().to(q.device) for x in proj)
        q = torch.einsum("phgd,hrd->phgr", q, pq)
        k = torch.einsum("thd,hrd->thr", k, pk)
    out = torch.full((p_cnt, h_kv, m), float("-inf"), device=q_post.device)
    if n_blocks and mass:
        dots = torch.einsum("phgr,thr->phgt", q, k) * d ** -0.5  # [P, H_kv, G, T']
        past = torch.arange(dots.shape[-1], device=dots.device)[None, :] >= (
            torch.div(positions, block_size, rounding_mode="floor") * block_size)[:, None]  # [P, T']
        # a large finite floor, not -inf: a query with no candidate keys then differentiates without NaNs
        dots = dots.masked_fill(past[:, None, None, :], -1e30)
        norm = dots - torch.logsumexp(dots, dim=-1, keepdim=True)
        blocks = torch.logsumexp(norm.view(p_cnt, h_kv, g, n_blocks, block_size), dim=-1)  # [P, H_kv, G, M']
        out[..., :n_blocks] = blocks.amax(dim=2)
    elif n_blocks:
        dots = torch.einsum("phgr,thr->phgt", q, k).amax(dim=2)  # [P, H_kv, T']
        out[..., :n_blocks] = dots.view(p_cnt, h_kv, n_blocks, block_size).amax(dim=-1)
    return out.masked_fill(~candidate_mask(positions, m, block_size), float("-inf"))


def pair_dims(pairs: torch.Tensor, head_dim: int) -> torch.Tensor:
    """`[H_kv, 2R]` channel indices of RoPE pairs `[H_kv, R]` (pair i = dims i and i + D/2)."""
    return torch.cat([pairs, pairs + head_dim // 2], dim=-1)


def calibrate_pairs(q_post: torch.Tensor, k_post: torch.Tensor, num_pairs: int, queries: int = 256,
                    seed: int = 0) -> torch.Tensor:
    """The `num_pairs` RoPE pairs per kv head `[H_kv, R]` (ascending) that spread the keys' scores most
    (`pair_spread`); q_post `[T, H_q, D]` and k_post `[T, H_kv, D]`: one layer's post-RoPE calibration tensors."""
    spread = pair_spread(q_post, k_post, queries, seed)
    return spread.topk(num_pairs, dim=-1).indices.sort(dim=-1).values


def pair_spread(q_post: torch.Tensor, k_post: torch.Tensor, queries: int = 256, seed: int = 0) -> torch.Tensor:
    """`[H_kv, D/2]`: per RoPE pair, the variance over a query's causal keys of the pair's share of q.k, averaged
    over `queries` sampled queries (from the second half) and the group's heads. A pair with large but uniform
    products (a constant offset to every key's score, as massive low-frequency channels give) spreads nothing.
    """
    t, h_q, d = q_post.shape
    h_kv = k_post.shape[1]
    half = d // 2
    g = torch.Generator().manual_seed(seed)
    rows = torch.randint(t // 2, t, (min(queries, t - t // 2),), generator=g)
    q = q_post.float()[rows].view(-1, h_kv, h_q // h_kv, d)  # [N, H_kv, G, D]
    qp = torch.stack([q[..., :half], q[..., half:]], dim=-1)  # [N, H_kv, G, D/2, 2]
    k = k_post.float()
    kp = torch.stack([k[..., :half], k[..., half:]], dim=-1)  # [T, H_kv, D/2, 2]
    # Var_j(q . k_j) over keys j <= i is q^T Cov_i q, Cov_i from prefix sums of k and k k^T (the pair's 2x2).
    s1 = kp.cumsum(0)[rows]  # [N, H_kv, D/2, 2]
    s2 = (kp[..., :, None] * kp[..., None, :]).cumsum(0)[rows]  # [N, H_kv, D/2, 2, 2]
    n = (rows + 1).float()[:, None, None, None]
    mean = s1 / n
    cov = s2 / n[..., None] - mean[..., :, None] * mean[..., None, :]
    var = torch.einsum("nhgpa,nhpab,nhgpb->nhgp", qp, cov, qp)  # [N, H_kv, G, D/2]
    spread = var.mean(dim=(0, 2))
    return spread


def sub_block_alias(name: str, block_size: int):
    """(server selector, sub_blocks) that `gatesub<S>` / `questsub<S>` / `gatesub<S>c<X>exact` name
    (`SelectionRule.sub_blocks` = b / S: the selector's summaries over S-token runs, a block scoring its best run),
    else None."""
    match, exact = CANDIDATE_PATTERN.match(name), GATE_EXACT_PATTERN.match(name)
    if exact is not None and exact.group(1) is not None:
        selector, size = "gate", int(exact.group(1))
    elif match is not None and match.group(3) is not None:
        selector, size = match.group(3), int(match.group(4))
    else:
        return None
    if size <= 0 or block_size % size:
        raise ValueError(f"{name}: the run size {size} must divide the block size {block_size}")
    return selector, block_size // size


def two_level_factor(name: str) -> Optional[int]:
    """X of a two-level candidate `gatesub<S>c<X>` (the first level keeps X x K blocks), else None."""
    match = CANDIDATE_PATTERN.match(name)
    if match is None or match.group(5) is None:
        return None
    if match.group(3) != "gate" or int(match.group(5)) < 1:
        raise ValueError(f"{name}: two levels need the gate and a factor of at least 1 (gatesub<S>c<X>)")
    return int(match.group(5))


def keep_first_level(scores: torch.Tensor, first: torch.Tensor, keep: int,
                     num_candidates: torch.Tensor) -> torch.Tensor:
    """`scores` `[P, H_kv, M]` with -inf outside each row's `keep` best candidate blocks by `first` `[P, H_kv, M]`
    (candidates: index < num_candidates `[P]`); rows with at most `keep` candidates keep them all."""
    m = scores.shape[-1]
    cand = (torch.arange(m, device=scores.device)[None, :] < num_candidates[:, None])[:, None, :]
    ranked = first.masked_fill(~cand, float("-inf"))
    kept = torch.zeros_like(cand.expand_as(scores))
    kept.scatter_(-1, ranked.topk(min(keep, m), dim=-1).indices, True)
    return scores.masked_fill(~(kept & cand), float("-inf"))


def candidate_scores(name: str, layer_idx: int, q_post, k_post, positions, block_size: int,
                     index: Optional[Dict[int, torch.Tensor]]) -> torch.Tensor:
    """Block scores `[P, H_kv, M]` of `exactmax` / `exactmass`, `pairs<R>` or `pca<R>` / `pca<R>mass` (module doc)
    for one layer; index:
    `{layer: [H_kv, R]}` RoPE pairs for `pairs<R>` (`calibrate_pairs`), `{layer: (Pq, Pk)}` for `pca<R>`
    (`fit_pca`)."""
    match = CANDIDATE_PATTERN.match(name)
    if match is None:
        raise ValueError(f"unknown candidate selector {name!r}")
    if name in ("exactmax", "exactmass"):
        return token_max_scores(q_post, k_post, positions, block_size, mass=name == "exactmass")
    if match.group(2) is not None:
        if not index or layer_idx not in index:
            raise ValueError(f"{name} needs calibrated RoPE pairs for layer {layer_idx}")
        pairs = index[layer_idx].to(q_post.device)
        if pairs.shape[-1] != int(match.group(2)):
            raise ValueError(f"{name}: the calibration holds {pairs.shape[-1]} pairs a kv head")
        return token_max_scores(q_post, k_post, positions, block_size, pair_dims(pairs, q_post.shape[-1]))
    if match.group(6) is not None:
        if not index or layer_idx not in index:
            raise ValueError(f"{name} needs a fitted projection for layer {layer_idx} (calibrate_model_pca, "
                             "hf.learned_keys)")
        pq, pk = index[layer_idx]
        if pk.shape[1] != int(match.group(7)):
            raise ValueError(f"{name}: the fitted projection has {pk.shape[1]} dims a kv head")
        return token_max_scores(q_post, k_post, positions, block_size, proj=(pq, pk), mass=bool(match.group(8)))
    raise ValueError(f"{name} runs as its server selector with sub-blocks (sub_block_alias)")


CALIB_ATTN_NAME = "sas_calibrate_pairs"


def _recording_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Dense causal attention that keeps this layer's post-RoPE q `[T, H_q, D]` and k `[T, H_kv, D]`."""
    module._sas_calib[module.layer_idx] = (query[0].transpose(0, 1).float(), key[0].transpose(0, 1).float())
    return causal_sdpa(query, key, value, scaling).transpose(1, 2), None


@torch.no_grad()
def record_model_qk(model, ids: torch.Tensor) -> Dict[int, tuple]:
    """`{layer: (q [T, H_q, D], k [T, H_kv, D])}` fp32 post-RoPE, from one dense forward of `ids` `[T]` through a
    transformers Llama / Qwen2 / Qwen3 model (calibration text: keep it out of any evaluation)."""
    from transformers import AttentionInterface

    AttentionInterface.register(CALIB_ATTN_NAME, _recording_attention)
    seen: Dict[int, tuple] = {}
    modules = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "q_proj")]
    for m in modules:
        m._sas_calib = seen
    previous = model.config._attn_implementation
    model.set_attn_implementation(CALIB_ATTN_NAME)
    try:
        model(torch.as_tensor(ids)[None], use_cache=False, logits_to_keep=1)
    finally:
        model.set_attn_implementation(previous)
        for m in modules:
            del m._sas_calib
    return seen


def calibrate_model_pairs(model, ids: torch.Tensor) -> Dict[int, torch.Tensor]:
    """`{layer: [H_kv, D/2]}` spread of every RoPE pair (`pair_spread`; `top_pairs` picks R of them) from one dense
    forward of `ids` `[T]` (`record_model_qk`)."""
    return {layer: pair_spread(q, k) for layer, (q, k) in record_model_qk(model, ids).items()}


def fit_pca(q_post: torch.Tensor, k_post: torch.Tensor, rank: int, eps: float = 1e-4):
    """(Pq, Pk), each `[H_kv, rank, D]`: the `pca<R>` projection (module doc) of one layer, from its post-RoPE
    calibration q `[T, H_q, D]` and k `[T, H_kv, D]`. With W the group's query second moment's square root,
    q.k = (W^-1 q).(W k) where W^-1 q has identity second moment, so the scores (Pq q).(Pk k) = q^T W^-1 V V^T W k
    keep the `rank` directions of W k with most variance over keys: the most of Var_k(q.k) a rank-`rank` map
    keeps, averaged over such queries."""
    t, h_q, d = q_post.shape
    h_kv = k_post.shape[1]
    if not 0 < rank <= d:
        raise ValueError(f"pca rank {rank} must be in 1..{d}")
    q = q_post.double().view(t, h_kv, h_q // h_kv, d).transpose(0, 1).reshape(h_kv, -1, d)  # [H_kv, T*G, D]
    k = k_post.double().transpose(0, 1)  # [H_kv, T, D]
    sq = q.transpose(1, 2) @ q / q.shape[1]
    sq = sq + eps * sq.diagonal(dim1=1, dim2=2).mean(-1)[:, None, None] * torch.eye(d, dtype=sq.dtype)
    evals, evecs = torch.linalg.eigh(sq)
    w = evecs @ torch.diag_embed(evals.sqrt()) @ evecs.transpose(1, 2)
    w_inv = evecs @ torch.diag_embed(evals.rsqrt()) @ evecs.transpose(1, 2)
    kc = k - k.mean(dim=1, keepdim=True)
    white = kc @ w  # W symmetric: rows are (W k)^T
    cov = white.transpose(1, 2) @ white / k.shape[1]
    v = torch.linalg.eigh(cov)[1][..., -rank:]  # [H_kv, D, R], leading last
    pq = (v.transpose(1, 2) @ w_inv).float()
    pk = (v.transpose(1, 2) @ w).float()
    return pq, pk


def calibrate_model_pca(model, ids: torch.Tensor, ranks) -> Dict[int, Dict[int, tuple]]:
    """`{rank: {layer: (Pq, Pk)}}` (`fit_pca`) for each of `ranks`, from one dense forward of `ids` `[T]`."""
    qk = record_model_qk(model, ids)
    return {r: {layer: fit_pca(q, k, r) for layer, (q, k) in qk.items()} for r in ranks}


def top_pairs(spread: Dict[int, torch.Tensor], num_pairs: int) -> Dict[int, torch.Tensor]:
    """`{layer: [H_kv, num_pairs]}` (ascending): each kv head's most spreading pairs of `calibrate_model_pairs`."""
    return {layer: s.topk(num_pairs, dim=-1).indices.sort(dim=-1).values for layer, s in spread.items()}
