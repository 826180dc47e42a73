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
- `gatesub<S>`: the trained gate applied to S-token sub-blocks (its max / min / mean pooling over S keys,
  RoPE at the sub-block's start), block score the max over its b/S sub-blocks: keeps b/S gate summaries a
  page (S = 16: 4 x Dg values, 1/16 of a 64-token page's bf16 K+V at D = 64, Dg = 128 ... in fp32 1/8).
"""

from __future__ import annotations

import re
from typing import Dict, Optional

import torch

CANDIDATE_PATTERN = re.compile(r"^(exactmax|pairs(\d+)|gatesub(\d+))$")


def is_candidate(name: str) -> bool:
    """Whether `name` names a candidate selector (`exactmax`, `pairs<R>`, `gatesub<S>`)."""
    return bool(CANDIDATE_PATTERN.match(name))


def candidate_mask(positions: torch.Tensor, width: int, block_size: int) -> torch.Tensor:
    """`[P, 1, width]` bool: block m is a candidate of the query at positions[p] (complete, before its own)."""
    n_cand = torch.div(positions, block_size, rounding_mode="floor")
    return (torch.arange(width, device=positions.device)[None, :] < n_cand[:, None])[:, None, :]


def token_max_scores(q_post: torch.Tensor, k_post: torch.Tensor, positions: torch.Tensor, block_size: int,
                     dims: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Scores `[P, H_kv, M]` = max over block m's tokens and the group's query heads of q.k (over `dims` only).

    q_post: `[P, H_q, D]`, k_post: `[T, H_kv, D]` post-RoPE; positions: `[P]`; dims: optional `[H_kv, R']`
    channel indices per kv head (None: all D). M = max(T // b, 1); -inf past each query's candidates.
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
    out = torch.full((p_cnt, h_kv, m), float("-inf"), device=q_post.device)
    if n_blocks:
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


def gate_sub_scores(gate, q_post, k_post, positions, model_table, gate_table, block_size: int,
                    sub_size: int) -> torch.Tensor:
    """Scores `[P, H_kv, M]`: the gate's score of each `sub_size`-token sub-block (its own pooled summary,
    RoPE at the sub-block start), max over the block's b / S sub-blocks; -inf past each query's candidates."""
    from sas_backend.ops.gate import gate_query_post_rope
    from sas_backend.ops.score import score_blocks
    from sas_backend.ops.summary import summarize_pages

    if block_size % sub_size:
        raise ValueError(f"sub-block size {sub_size} must divide the block size {block_size}")
    per = block_size // sub_size
    t = k_post.shape[0]
    n_blocks = t // block_size
    m = max(n_blocks, 1)
    n_sub = n_blocks * per
    subs = torch.arange(n_sub, device=k_post.device)
    summaries = summarize_pages(k_post, subs, subs * sub_size, model_table, gate_table,
                                gate.attngate_linear_k.weight, gate.attngate_knorm.weight, sub_size)
    gate_q = gate_query_post_rope(q_post, model_table[positions], gate.attngate_linear_q.weight,
                                  gate.attngate_qnorm.weight, gate_table[positions])
    n_cand = torch.div(positions, block_size, rounding_mode="floor") * per
    table = (torch.arange(max(n_sub, 1) + 1, device=k_post.device) * sub_size).expand(positions.numel(), -1)
    sub = score_blocks(gate_q, summaries, table, n_cand, sub_size, max(n_sub, 1))  # [P, H_kv, n_sub]
    out = torch.full((positions.numel(), k_post.shape[1], m), float("-inf"), device=k_post.device)
    if n_blocks:
        out[..., :n_blocks] = sub.view(sub.shape[0], sub.shape[1], n_blocks, per).amax(dim=-1)
    return out.masked_fill(~candidate_mask(positions, m, block_size), float("-inf"))


def candidate_scores(name: str, layer_idx: int, q_post, k_post, positions, block_size: int, model_table,
                     gate_table, gates: Optional[dict], index: Optional[Dict[int, torch.Tensor]]) -> torch.Tensor:
    """Block scores `[P, H_kv, M]` of candidate `name` (module doc) for one layer; index: `{layer: [H_kv, R]}`
    RoPE pairs for `pairs<R>` (`calibrate_pairs`)."""
    match = CANDIDATE_PATTERN.match(name)
    if match is None:
        raise ValueError(f"unknown candidate selector {name!r}")
    if name == "exactmax":
        return token_max_scores(q_post, k_post, positions, block_size)
    if match.group(2) is not None:
        if not index or layer_idx not in index:
            raise ValueError(f"{name} needs calibrated RoPE pairs for layer {layer_idx}")
        pairs = index[layer_idx].to(q_post.device)
        if pairs.shape[-1] != int(match.group(2)):
            raise ValueError(f"{name}: the calibration holds {pairs.shape[-1]} pairs a kv head")
        return token_max_scores(q_post, k_post, positions, block_size, pair_dims(pairs, q_post.shape[-1]))
    if not gates:
        raise ValueError(f"{name} needs the gate")
    return gate_sub_scores(gates[layer_idx], q_post, k_post, positions, model_table, gate_table, block_size,
                           int(match.group(3)))


CALIB_ATTN_NAME = "sas_calibrate_pairs"


def _recording_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Dense causal attention that keeps this layer's post-RoPE q `[T, H_q, D]` and k `[T, H_kv, D]`."""
    from sas_backend.hf.sparse_eval import causal_sdpa

    module._sas_calib[module.layer_idx] = (query[0].transpose(0, 1).float(), key[0].transpose(0, 1).float())
    return causal_sdpa(query, key, value, scaling).transpose(1, 2), None


@torch.no_grad()
def calibrate_model_pairs(model, ids: torch.Tensor) -> Dict[int, torch.Tensor]:
    """`{layer: [H_kv, D/2]}` spread of every RoPE pair (`pair_spread`; `top_pairs` picks R of them) from one dense
    forward of `ids` `[T]` through a transformers Llama / Qwen2 / Qwen3 model (calibration text: keep it out of
    any evaluation)."""
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
    return {layer: pair_spread(q, k) for layer, (q, k) in seen.items()}


def top_pairs(spread: Dict[int, torch.Tensor], num_pairs: int) -> Dict[int, torch.Tensor]:
    """`{layer: [H_kv, num_pairs]}` (ascending): each kv head's most spreading pairs of `calibrate_model_pairs`."""
    return {layer: s.topk(num_pairs, dim=-1).indices.sort(dim=-1).values for layer, s in spread.items()}
