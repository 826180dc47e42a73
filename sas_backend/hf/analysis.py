"""The SAS paper's selection analysis inside the sparse-evaluation harness: per-layer attention-mass coverage of
the selected blocks and the cross-layer overlap recall of the oracle's blocks, for any selector
(`SparseEvalSpec`: a gate, quest, sink-local, oracle, random).

`block_analysis(model, spec, acc)` is `hf.sparse_eval.sparse_eval` with its own attention function
(`analysis_attention`) that calls `sparse_eval_attention` (the harness's selection and sparse rows, unchanged) and
then measures the selection it recorded against the dense attention of the same queries, keys and values. Only the
sparse queries (positions >= `spec.sparse_from`) of layers that select (>= `spec.first_sparse_layer`) are measured.
Notation per layer: query head (h, g) is query head h*G+g of kv head h (G = H_q / H_kv), query p sits at position
pos(p), l_j = q.k_j * scale for each causal key j <= pos(p) (post-RoPE q and k, the model's softmax scale), b the
block size, K = spec.top_k, the candidates of p are the complete blocks m < pos(p) // b, S(l, h, p) the K (or
fewer) blocks the selector picked for kv head h (forced sink/local blocks and prompt anchors included: what
`record` receives), own(p) = block pos(p) // b.

(a) Coverage, per layer: what the sparse row attends is A = {j : block(j) in S(l, h, p)} + {j in own(p), j <=
pos(p)}. For query head (h, g) and query p,

    raw   = sum_{j in A} exp(l_j)              / sum_{j <= pos(p)} exp(l_j)
    value = sum_{j in A} exp(l_j + log |v_j|)  / sum_{j <= pos(p)} exp(l_j + log |v_j|)

with |v_j| the L2 norm of key j's value vector (its kv head's). Each layer's number is the mean over its query
heads and queries (and over forwards: every window weighs the same). A budget covering the context gives 1.

(b) Overlap recall. The oracle's block set O(l, h, p), per kv-head group h: each of the G query heads ranks the
candidates by its own raw attention mass (the dense causal softmax of l summed over the block's keys) and takes
its top K, ties to the lower block index (the selection rule's tie rule), all candidates when there are at most K;
block m is in O(l, h, p) iff at least half of the G heads took it: 2 * votes >= G (so with an even G exactly half
is enough, ties are IN; with an odd G, as SmolLM2's G = 3, it is a strict majority, 2 of 3). Then, per query:

    per kv head h:   UO(h, p) = union over layers l of O(l, h, p),   US(h, p) = union over l of S(l, h, p),
                     recall(h) = mean over queries p of |UO(h, p) & US(h, p)| / |UO(h, p)|
    over all heads:  UO(p) = union over l and h of O(l, h, p),        US(p) likewise,
                     recall_all = mean over p of |UO(p) & US(p)| / |UO(p)|

(blocks are logical: block m is positions [m*b, (m+1)*b) in every layer and head, so unions across heads are
unions of context positions); a query with an empty UO (no candidates) is left out. Also reported: the per-layer
recall (mean over layers, kv heads and queries of |O & S| / |O|, no union), the union recall's reference point.

Primary reading: per kv head (`union_recall_kv_mean`, the mean of recall(h) over the kv heads). The issue's
statement of the paper's analysis makes the kv-head group the unit ("per kv-head group, the oracle's block set ...
its union over layers"), the selection is made per kv head (the G heads of a group share it), and so the question
"does the gate pick, somewhere in the depth, the blocks this head group needs" is asked per group; the all-heads
union asks the coarser "is the block read anywhere in the model", and with H_kv groups in every layer it saturates
sooner (it is the larger set on both sides). Caveat, said in the report too: kv head h of layer l and kv head h of
layer l' share an index, not a role; the all-heads number does not depend on that pairing, which is why both are
reported.

Activations: "sparse" (default) measures the model as it runs sparse (each measured layer's output is the sparse
attention, so later layers see what serving computes and each selector is judged against the dense attention of
its own rows); "dense" returns the dense attention instead, so every selector is measured on the dense model's
queries, keys and values at every layer (selectors then compare layer by layer on equal inputs; the logits are
the dense model's).
"""

from __future__ import annotations

import contextlib
import math
from typing import Dict, List, Optional

import torch

from sas_backend.hf.sparse_eval import (
    ATTN_NAME,
    SparseEvalSpec,
    causal_sdpa,
    sparse_eval,
    sparse_eval_attention,
)

ANALYSIS_ATTN_NAME = "sas_block_analysis"
ACTIVATIONS = ("sparse", "dense")


def block_weights(logits: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, block_size: int,
                  overwrite: bool = False):
    """Per query head, query and block, the summed weights of the block's causal keys: (raw, value-aware), each
    `[H_kv, G, P, ceil(T / b)]` fp32 (the last block may be partial), raw = exp(l_j - c), value-aware =
    exp(l_j - c + log |v_j|) with c the row's max over its causal keys (it cancels in every ratio); a row's sum
    over blocks is its normalizer over the causal keys.

    logits `[H_kv, G, P, T]` fp32 (scaled q.k; overwrite: used as the scratch, its values lost), values
    `[H_kv, T, D]` (|v_j|: L2 norm of key j's value), positions `[P]` (query p sees keys <= positions[p])."""
    h_kv, g, n_p, t = logits.shape
    e = logits if overwrite and logits.dtype == torch.float32 else logits.float().clone()
    first = int(positions.min())  # keys before it are causal for every query: only the tail needs the mask
    tail_causal = torch.arange(first, t, device=e.device)[None, :] <= positions[:, None]  # [P, T - first]
    tail = e[..., first:]
    c = tail.masked_fill(~tail_causal, float("-inf")).amax(-1, keepdim=True)
    if first:
        c = torch.maximum(c, e[..., :first].amax(-1, keepdim=True))
    e = e.sub_(c).exp_()  # one pass over [H_kv, G, P, T]
    e[..., first:].masked_fill_(~tail_causal, 0.0)  # the non-causal keys weigh exactly 0
    n_all = -(-t // block_size)

    def per_block(x):
        if n_all * block_size != t:
            x = torch.nn.functional.pad(x, (0, n_all * block_size - t))
        return x.view(h_kv, g, n_p, n_all, block_size).sum(-1)

    raw = per_block(e)
    value = per_block(e.mul_(values.float().norm(dim=-1)[:, None, None, :]))
    return raw, value


def attended_blocks(selected: torch.Tensor, positions: torch.Tensor, block_size: int, width: int) -> torch.Tensor:
    """`[P, H_kv, width]` bool: the blocks the sparse row reads, the selected ones and the query's own (whose keys
    past the query have weight 0 in `block_weights`, so its causal part is what counts)."""
    out = selected_sets(selected, width)
    own = torch.div(positions, block_size, rounding_mode="floor")
    out[torch.arange(positions.numel(), device=out.device), :, own] = True
    return out


def coverage(weights: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
    """`[H_kv, G, P]` share of each row's weight that the attended blocks hold: weights `[H_kv, G, P, NB]`
    (`block_weights`), attended `[P, H_kv, NB]` bool. All causal blocks attended: exactly 1."""
    kept = (weights * attended.transpose(0, 1)[:, None]).sum(-1)
    return kept / weights.sum(-1)


def oracle_sets(logits: torch.Tensor, positions: torch.Tensor, block_size: int, top_k: int,
                raw: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The oracle's block sets `[P, H_kv, NB]` bool (NB = T // b): block m is in kv head h's set for query p iff at
    least half of the group's G query heads (2 * votes >= G) have m among their own top `top_k` candidate blocks by
    raw attention mass (ties to the lower block index; every candidate when there are at most `top_k`).

    logits `[H_kv, G, P, T]` (scaled q.k); positions `[P]`; the candidates of p are blocks m < positions[p] // b.
    raw: `block_weights(...)[0]` when already computed (the mass up to the row's normalizer: the same ranking)."""
    h_kv, g, _, t = logits.shape
    nb = t // block_size
    if raw is None:
        raw = block_weights(logits, logits.new_ones(h_kv, t, 1), positions, block_size)[0]
    mass = raw[..., :nb]  # [H_kv, G, P, NB], complete blocks
    own = torch.div(positions, block_size, rounding_mode="floor")
    cand = torch.arange(nb, device=logits.device)[None, :] < own[:, None]
    key = mass.masked_fill(~cand, float("-inf"))  # mass >= 0: every candidate ranks before every non-candidate
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices  # stable: lower index first among ties
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(nb, device=logits.device).expand_as(order))
    picks = (rank < top_k) & cand  # [H_kv, G, P, NB]
    votes = picks.sum(1)  # [H_kv, P, NB]
    return (2 * votes >= g).transpose(0, 1) & cand[:, None, :]


def selected_sets(selected: torch.Tensor, width: int) -> torch.Tensor:
    """`[P, H_kv, width]` bool from selected block indices `[P, H_kv, K]` (-1 padded)."""
    p_cnt, h_kv, _ = selected.shape
    out = torch.zeros(p_cnt, h_kv, width + 1, dtype=torch.bool, device=selected.device)
    out.scatter_(-1, torch.where(selected >= 0, selected.long(), width), True)
    return out[..., :width]


def _ratio_sums(oracle: torch.Tensor, chosen: torch.Tensor):
    """(sum over rows with a non-empty oracle set of |O & S| / |O|, how many such rows, sum |O|, sum |S|) over
    the leading axis, the sets on the last: tensors shaped like oracle's middle axes (or scalars)."""
    size = oracle.sum(-1)
    inter = (oracle & chosen).sum(-1)
    valid = size > 0
    ratio = torch.where(valid, inter / size.clamp_min(1), torch.zeros((), device=oracle.device))
    return ratio.sum(0), valid.sum(0), size.sum(0), chosen.sum(-1).sum(0)


class BlockAnalysis:
    """Accumulates (a) coverage and (b) overlap recall over forwards (windows) of one selector at one budget.

    `add_layer` per measured layer of a forward; `end_forward` after it (`block_analysis` calls both; a repeated
    layer index also ends the forward before it). `result()` has the means (module doc)."""

    def __init__(self, top_k: int, block_size: int):
        self.top_k, self.block_size = top_k, block_size
        self.coverage_raw: Dict[int, List[float]] = {}  # layer -> [sum over (query head, query), count]
        self.coverage_value: Dict[int, List[float]] = {}
        self.layer_recall: Dict[int, List[float]] = {}  # layer -> [sum of |O & S| / |O| over (kv head, query), n]
        self.union_kv: Optional[List[List[float]]] = None  # per kv head [ratio sum, queries, |UO| sum, |US| sum]
        self.union_all = [0.0, 0, 0.0, 0.0]
        self.candidates = [0, 0]  # [sum of candidate counts, queries] (context for the union sizes)
        self.forwards = 0
        self._uo = self._us = None
        self._layers: set = set()

    @torch.no_grad()
    def add_layer(self, layer: int, logits: torch.Tensor, values: torch.Tensor, selected: torch.Tensor,
                  positions: torch.Tensor) -> None:
        """logits `[H_kv, G, P, T]` fp32 (scaled q.k of the measured queries; overwritten), values `[H_kv, T, D]`,
        selected `[P, H_kv, K]` (the selection the sparse rows attended), positions `[P]`."""
        if layer in self._layers:
            self.end_forward()
        self._layers.add(layer)
        b = self.block_size
        raw, value = block_weights(logits, values, positions, b, overwrite=True)
        attended = attended_blocks(selected, positions, b, raw.shape[-1])  # what the sparse row reads
        for acc, w in ((self.coverage_raw, raw), (self.coverage_value, value)):
            c = coverage(w, attended)
            got = acc.setdefault(layer, [0.0, 0])
            got[0] += float(c.double().sum())
            got[1] += c.numel()
        oracle = oracle_sets(logits, positions, b, self.top_k, raw=raw)  # [P, H_kv, NB]
        chosen = selected_sets(selected, oracle.shape[-1])
        r_sum, r_n, _, _ = _ratio_sums(oracle, chosen)
        got = self.layer_recall.setdefault(layer, [0.0, 0])
        got[0] += float(r_sum.double().sum())
        got[1] += int(r_n.sum())
        if self._uo is None:
            self._uo, self._us = oracle.clone(), chosen.clone()
            self._n_cand = torch.div(positions, b, rounding_mode="floor")
        else:
            self._uo |= oracle
            self._us |= chosen

    def end_forward(self) -> None:
        """Fold the current forward's unions over layers into the recall sums (no-op without measured layers)."""
        if self._uo is None:
            return
        per_head = _ratio_sums(self._uo, self._us)  # each [H_kv]
        if self.union_kv is None:
            self.union_kv = [[0.0, 0, 0.0, 0.0] for _ in range(self._uo.shape[1])]
        for h, row in enumerate(self.union_kv):
            for i, v in enumerate(per_head):
                row[i] += float(v[h])
        for i, v in enumerate(_ratio_sums(self._uo.any(1), self._us.any(1))):
            self.union_all[i] += float(v)
        self.candidates[0] += int(self._n_cand.sum())
        self.candidates[1] += int(self._n_cand.numel())
        self.forwards += 1
        self._uo = self._us = None
        self._layers = set()

    def result(self) -> dict:
        """Means: coverage_raw / coverage_value / layer_recall `{layer: mean}`, their means over layers,
        union_recall_per_kv_head `[H_kv]`, union_recall_kv_mean (primary), union_recall_all_heads, and the mean
        union sizes in blocks (oracle, selected: per kv head and over all heads) beside the mean candidates."""
        def means(acc):
            return {layer: s / n for layer, (s, n) in sorted(acc.items()) if n}

        def avg(d):
            return sum(d.values()) / len(d) if d else float("nan")

        raw, val, rec = means(self.coverage_raw), means(self.coverage_value), means(self.layer_recall)
        kv = [r[0] / r[1] if r[1] else float("nan") for r in (self.union_kv or [])]
        q_kv = sum(r[1] for r in self.union_kv or []) or 1
        q_all = self.union_all[1] or 1
        return {
            "forwards": self.forwards,
            "coverage_raw": raw, "coverage_value": val,
            "coverage_raw_mean": avg(raw), "coverage_value_mean": avg(val),
            "layer_recall": rec, "layer_recall_mean": avg(rec),
            "union_recall_per_kv_head": kv,
            "union_recall_kv_mean": sum(kv) / len(kv) if kv else float("nan"),
            "union_recall_all_heads": self.union_all[0] / q_all if self.union_all[1] else float("nan"),
            "union_blocks": {
                "oracle_per_kv_head": sum(r[2] for r in self.union_kv or []) / q_kv,
                "selected_per_kv_head": sum(r[3] for r in self.union_kv or []) / q_kv,
                "oracle_all_heads": self.union_all[2] / q_all,
                "selected_all_heads": self.union_all[3] / q_all,
                "candidates": self.candidates[0] / max(self.candidates[1], 1),
            },
        }


def analysis_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """transformers attention function: `sparse_eval_attention` (the harness's rows), then its recorded selection
    measured into the context's `BlockAnalysis`; returns the sparse rows ("sparse" activations) or the dense
    attention ("dense")."""
    ctx, an = module._sas_eval, module._sas_analysis
    layer = module.layer_idx
    record = ctx["record"]
    record.pop(layer, None)
    out, _ = sparse_eval_attention(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
    selected = record.get(layer)
    if selected is not None:  # this layer selected (not dense, not before first_sparse_layer)
        spec: SparseEvalSpec = ctx["spec"]
        h_q, t_q, t = query.shape[1], query.shape[2], key.shape[2]
        h_kv = key.shape[1]
        offset = t - t_q
        start = max(spec.sparse_from, offset)  # as sparse_eval_attention picks its sparse rows
        positions = torch.arange(start, t, device=query.device)
        n_p = positions.numel()
        # scaled first: with a power-of-two scale (1/sqrt(D) for D = 16, 64, 256) the harness's logits bit for bit
        qs = (query[0, :, start - offset:].float() * scaling).reshape(h_kv, (h_q // h_kv) * n_p, -1)
        logits = torch.bmm(qs, key[0].float().transpose(1, 2)).view(h_kv, h_q // h_kv, n_p, t)
        an["acc"].add_layer(layer, logits, value[0], selected, positions)
    if an["activations"] == "dense":
        out = causal_sdpa(query, key, value, scaling).transpose(1, 2)
    return out, None


@contextlib.contextmanager
def block_analysis(model, spec: SparseEvalSpec, acc: BlockAnalysis, activations: str = "sparse",
                   max_pos: Optional[int] = None):
    """Within the block, `model(...)` runs `spec`'s sparse attention (`sparse_eval`) and each forward's coverage
    and overlap recall accumulate into `acc` (ended on leaving the block, or when a layer repeats)."""
    from transformers import AttentionInterface

    if activations not in ACTIVATIONS:
        raise ValueError(f"activations must be one of {ACTIVATIONS}, got {activations!r}")
    if acc.top_k != spec.top_k or acc.block_size != spec.block_size:
        raise ValueError("the analysis and the spec disagree on top_k or block_size")
    with sparse_eval(model, spec, max_pos=max_pos, record={}):
        AttentionInterface.register(ANALYSIS_ATTN_NAME, analysis_attention)
        attn_modules = [m for m in model.modules() if hasattr(m, "_sas_eval")]
        for m in attn_modules:
            m._sas_analysis = {"acc": acc, "activations": activations}
        model.set_attn_implementation(ANALYSIS_ATTN_NAME)
        try:
            yield model
            acc.end_forward()
        finally:
            model.set_attn_implementation(ATTN_NAME)  # sparse_eval restores the model's own on leaving
            for m in attn_modules:
                del m._sas_analysis


def weakest_layers(per_layer: Dict[int, float], n: int = 3) -> List[tuple]:
    """The `n` layers of lowest value, lowest first: `[(layer, value), ...]`."""
    return sorted(per_layer.items(), key=lambda kv: (kv[1], kv[0]))[:n] if per_layer else []


def finite(x: float) -> Optional[float]:
    """x, or None for NaN / inf (JSON has no NaN)."""
    return x if isinstance(x, (int, float)) and math.isfinite(x) else None
