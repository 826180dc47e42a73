"""SAS sparse attention inside a transformers causal LM (Llama, Qwen2, Qwen3), for evaluation.

Queries at positions >= `sparse_from` attend exactly what a `sas` decode step would attend at
that position: their selected Top-K complete blocks plus their own block up to themselves;
earlier queries attend densely (as after a dense prefill). The selection is the component the
server uses (`sas_backend.selection`), run on the sequence viewed as SGLang's paged cache (page
m = block m); its ops are checked against their plain references in tests/ops. What this
module checks in the server tests is everything around them: the server's paging, RoPE tables,
plans and CUDA graphs against transformers' own forward. It is also the engine of the
perplexity tables.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Dict, Optional

import torch

from sas_backend.gate.module import AttnGate
from sas_backend.hf.causal import causal_sdpa
from sas_backend.hf.candidates import (
    candidate_scores, gate_exact_factor, grouped_second_level, grouping, is_candidate, is_grouped, keep_first_level,
    quantize_keys, quantize_summaries, rerank_key_bits, sub_block_alias, summary_bits, two_level_factor,
)
from sas_backend.ops.anchors import block_mass, force_anchors, top_anchors
from sas_backend.ops.rerank import rerank_blocks
from sas_backend.ops.rerank.torch_path import block_logsumexp
from sas_backend.selection import SelectionRule, make_selector, selector_class, selector_names

ATTN_NAME = "sas_sparse_eval"
# The server's selectors, plus evaluation-only references: "oracle" ranks blocks by their true
# attention mass (max over the kv group's query heads, from the dense softmax), "random" draws
# scores (seeded by layer), "dense" attends everything. Candidate selectors for long context
# (`hf.candidates`: exactmax, pairs<R>, gatesub<S>) are accepted by name too.
EVAL_ONLY = ("oracle", "random", "dense")


def eval_selectors() -> tuple:
    """The names `SparseEvalSpec.selector` takes: the registry's served selectors as registered now (a plugin's
    included once it registered), then `EVAL_ONLY`."""
    return tuple(selector_names()) + EVAL_ONLY

# What block summaries can be stored in (`SparseEvalSpec.summary_dtype`), by the names the CLIs take.
SUMMARY_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# What the gate's weights can be read from (`SparseEvalSpec.gate_dtype`): the same two.
GATE_DTYPES = SUMMARY_DTYPES


@dataclasses.dataclass
class SparseEvalSpec:
    """How queries select blocks.

    top_k: previous complete blocks each sparse query attends (its own block comes on top).
    selector: one of `eval_selectors()` ("gate": AttnGate scores; "quest": key min/max bound; "sink-local":
    the first block(s) and the most recent ones; "oracle": true attention mass; "random"; "dense").
    gates: `{layer: AttnGate}` for the "gate" selector. sparse_from: first sparse query position.
    sink_blocks / local_blocks: forced blocks inside K (sink-local: sink default 1, local = K - sink).
    anchors: optional `{layer: [H_kv, R]}` block indices forced for every sparse query (inside K, after the
    sink and local blocks; -1 = none), e.g. `prompt_anchors`' blocks the prompt's last queries attended most.
    summary_dtype: what block summaries are stored in between summarizing and scoring (the "gate" and "quest"
    selectors, the ones with summaries): torch.float32 (default: as computed) or torch.bfloat16 (rounded to bf16
    as a bf16 summary pool stores them, read back as fp32 for the score).
    gate_dtype: what the gate selector reads the gate's weights from (all of its parameters: the query and key
    projections and both RMSNorm weights): torch.float32 (default: the weights as loaded) or torch.bfloat16
    (rounded to bf16 and read back as fp32, as an fp32-computing kernel reading a bf16 copy of them sees them;
    `AttnGate.read_as`). The other selectors have no gate.
    index: `{layer: [H_kv, R]}` RoPE channel pairs of the `pairs<R>` candidate (`hf.candidates.calibrate_pairs`).
    sub_blocks: summaries per block of the gate and quest selectors (`SelectionRule.sub_blocks`); the candidate
    names `gatesub<S>` / `questsub<S>` set it to b / S.
    kv_fp8: an fp8 dtype (torch.float8_e4m3fn / float8_e5m2) the keys and values are rounded through wherever this
    attention reads them (an fp8 KV cache with scale 1: dense rows, selection and sparse rows alike; with the
    "dense" selector, dense attention over the fp8 cache); None: as computed.
    """

    top_k: int
    block_size: int = 64
    selector: str = "gate"
    gates: Optional[Dict[int, AttnGate]] = None
    sink_blocks: int = 0
    local_blocks: int = 0
    sparse_from: int = 0
    first_sparse_layer: int = 0
    anchors: Optional[Dict[int, torch.Tensor]] = None
    summary_dtype: torch.dtype = torch.float32
    gate_dtype: torch.dtype = torch.float32
    index: Optional[Dict[int, torch.Tensor]] = None
    sub_blocks: int = 1
    kv_fp8: Optional[torch.dtype] = None

    def __post_init__(self):
        if self.kv_fp8 is not None and self.kv_fp8 not in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise ValueError(f"kv_fp8 must be torch.float8_e4m3fn or torch.float8_e5m2, got {self.kv_fp8!r}")
        for field, allowed in (("summary_dtype", SUMMARY_DTYPES), ("gate_dtype", GATE_DTYPES)):
            if getattr(self, field) not in allowed.values():
                raise ValueError(f"{field} must be torch.float32 or torch.bfloat16, got {getattr(self, field)!r}")
        if self.selector not in eval_selectors() and not is_candidate(self.selector):
            raise ValueError(f"selector must be one of {eval_selectors()} or a candidate (hf.candidates), "
                             f"got {self.selector!r}")
        gated = self.selector in selector_names() and selector_class(self.selector).needs_gate
        if (gated or self.selector.startswith(("gatesub", "gatec"))) and not self.gates:
            raise ValueError("the gate selector needs gates")


def model_rope_table(model, max_pos: int, device=None) -> torch.Tensor:
    """`[max_pos, D]` fp32 cos|sin table from the model's own rotary module."""
    rotary = model.model.rotary_emb
    pos = torch.arange(max_pos, device=device)[None]
    x = torch.zeros(1, dtype=torch.float32, device=device)
    cos, sin = rotary(x, pos)
    half = cos.shape[-1] // 2
    return torch.cat([cos[0, :, :half], sin[0, :, :half]], dim=-1).float()


def select_for_queries(spec: SparseEvalSpec, layer_idx: int, q_post, k_post, positions, model_table, gate_table,
                       logits=None):
    """Selected blocks `[P, H_kv, K]` (ascending, -1 padded) for the queries at `positions` `[P]`.

    q_post: `[P, H_q, D]`, k_post: `[T, H_kv, D]` after the model's RoPE; model_table: the model's
    `[max_pos, D]` cos|sin; gate_table: the gate's `[max_pos, Dg]` (gate selector only); logits:
    `[H_kv, G, P, T]` scaled q.k of these queries (oracle only). The T keys are viewed as SGLang's
    paged cache with page m = block m (slot = position), so the server's selectors run unchanged.
    """
    selector, scores, n_cand = _block_scores(spec, layer_idx, q_post, k_post, positions, model_table, gate_table,
                                             logits)
    return selector.pick(scores, n_cand)


def block_scores(spec: SparseEvalSpec, layer_idx: int, q_post, k_post, positions, model_table, gate_table,
                 logits=None) -> torch.Tensor:
    """The scores `[P, H_kv, max(T // b, 1)]` fp32 that `select_for_queries` picks from (same arguments; prompt
    anchors, when the spec has them, already forced; `pick` ignores the columns past each query's candidates)."""
    return _block_scores(spec, layer_idx, q_post, k_post, positions, model_table, gate_table, logits)[1]


def _block_scores(spec, layer_idx, q_post, k_post, positions, model_table, gate_table, logits):
    """(selector, scores, candidates per query) for `select_for_queries` and `block_scores`."""
    b = spec.block_size
    t, h_kv, _ = k_post.shape
    n_blocks = t // b
    m = max(n_blocks, 1)
    n_cand = torch.div(positions, b, rounding_mode="floor")
    name, sub_blocks = spec.selector if spec.selector in selector_names() else "gate", spec.sub_blocks
    alias = sub_block_alias(spec.selector, b)
    if alias is not None:
        name, sub_blocks = alias
    selector = make_selector(name, SelectionRule(spec.top_k, b, spec.sink_blocks, spec.local_blocks, sub_blocks))
    if spec.selector == "oracle":
        return selector, oracle_scores(logits, positions, b, m), n_cand
    if spec.selector == "random":
        g = torch.Generator().manual_seed(1000 + layer_idx)
        return selector, torch.rand(positions.numel(), h_kv, m, generator=g).to(q_post.device), n_cand
    exact_factor = gate_exact_factor(spec.selector)
    if is_candidate(spec.selector) and alias is None and exact_factor is None:
        scores = candidate_scores(spec.selector, layer_idx, q_post, k_post, positions, b, spec.index)
        if spec.anchors is not None and layer_idx in spec.anchors:
            scores = force_anchors(scores, spec.anchors[layer_idx].expand(positions.numel(), -1, -1), n_cand)
        return selector, scores, n_cand
    gate = spec.gates[layer_idx].read_as(spec.gate_dtype) if selector_class(name).needs_gate else None
    pages = torch.arange(n_blocks, device=q_post.device)
    summaries = selector.summarize(gate, k_post, pages, pages * b, model_table, gate_table)  # [NB, H_kv, S]
    if spec.summary_dtype != torch.float32:  # stored in the pool's dtype, read back as fp32 for the score
        summaries = summaries.to(spec.summary_dtype).float()
    if summary_bits(spec.selector) is not None:  # the candidate's summaries stored in that many bits
        summaries = quantize_summaries(summaries, summary_bits(spec.selector), summaries.shape[-1] // sub_blocks)
    block_table = (torch.arange(m + 1, device=q_post.device) * b).expand(positions.numel(), -1)
    gate_rows = gate_table[positions] if gate_table is not None else None
    scores = selector.scores(gate, q_post, model_table[positions], gate_rows, summaries, block_table, n_cand, m)
    factor = two_level_factor(spec.selector)
    if factor is not None:  # the first level: one summary a block keeps factor x K blocks for the runs to rank
        first = make_selector(name, dataclasses.replace(selector.rule, sub_blocks=1))
        whole = first.summarize(gate, k_post, pages, pages * b, model_table, gate_table)
        if spec.summary_dtype != torch.float32:
            whole = whole.to(spec.summary_dtype).float()
        first_scores = first.scores(gate, q_post, model_table[positions], gate_rows, whole, block_table, n_cand, m)
        scores = keep_first_level(scores, first_scores, factor * spec.top_k, n_cand)
    anchors = None
    if spec.anchors is not None and layer_idx in spec.anchors:
        anchors = spec.anchors[layer_idx].expand(positions.numel(), -1, -1)
        scores = force_anchors(scores, anchors, n_cand)
    if exact_factor is not None:  # the server's two levels (`--sas-exact-rerank X`, ops.rerank), as it runs them
        bits = rerank_key_bits(spec.selector)
        keys = k_post if bits is None else quantize_keys(k_post, bits, b)
        scores = _exact_second_level(selector, exact_factor, scores, q_post, keys, block_table, n_cand, m, anchors,
                                     grouping=grouping(spec.selector) if is_grouped(spec.selector) else None)
    return selector, scores, n_cand


# Rows of queries the exact second level scores at once (its torch path gathers each row's X x K blocks' keys).
_RERANK_ROWS = 64


def _exact_second_level(selector, factor: int, scores, q_post, k_post, block_table, n_cand, m: int, anchors,
                        grouping: Optional[str] = None):
    """Scores `[P, H_kv, M]` that `selector.pick` turns into the server's two-level selection: the first level picks
    factor x K blocks from `scores` (forced blocks and anchors in), `ops.rerank.rerank_blocks` keeps K of them by
    their exact attention mass; the kept blocks score 0, the rest -inf (the pick then takes exactly them: they
    hold the forced ones, and a row with at most K candidates keeps all). The softmax scale is D^-1/2 (every model
    evaluated here). `grouping` (`snake` / `tier`): `hf.candidates.grouped_second_level` in place of
    `rerank_blocks` (a screen)."""
    rule = selector.rule
    first = make_selector(selector.name, dataclasses.replace(rule, top_k=factor * rule.top_k)).pick(scores, n_cand)
    out = torch.full_like(scores, float("-inf"))
    scale = q_post.shape[-1] ** -0.5
    for r0 in range(0, q_post.shape[0], _RERANK_ROWS):
        rows = slice(r0, r0 + _RERANK_ROWS)
        if grouping is not None:
            f = first[rows]
            lse = block_logsumexp(q_post[rows], k_post, f, block_table[rows], rule.block_size, scale)
            first_scores = torch.gather(scores[rows], -1, f.clamp_min(0).long())
            keep = grouped_second_level(f, first_scores, lse, n_cand[rows], rule.top_k, factor, rule.sink_blocks,
                                        rule.local_blocks, None if anchors is None else anchors[rows], grouping)
            wide = torch.full((f.shape[0], f.shape[1], m + 1), float("-inf"), device=scores.device)
            out[rows] = wide.scatter_(-1, torch.where(keep, f.long(), m), 0.0)[..., :m]
            continue
        kept = rerank_blocks(q_post[rows], k_post, first[rows], block_table[rows], n_cand[rows], rule.top_k, m,
                             scale, rule.block_size, rule.sink_blocks, rule.local_blocks,
                             None if anchors is None else anchors[rows])
        wide = torch.full((kept.shape[0], kept.shape[1], m + 1), float("-inf"), device=scores.device)
        out[rows] = wide.scatter_(-1, torch.where(kept >= 0, kept.long(), m), 0.0)[..., :m]
    return out


def oracle_scores(logits: torch.Tensor, positions: torch.Tensor, block_size: int, width: int) -> torch.Tensor:
    """Attention mass of each block `[P, H_kv, width]`: the dense causal softmax of `logits`
    `[H_kv, G, P, T]` summed over each block's tokens, max over the G query heads of a kv head
    (`ops.anchors.block_mass`, the rule the server's prompt anchors use too)."""
    return block_mass(logits, positions, block_size, width)


def _sparse_rows_mask(selected, positions, t: int, b: int) -> torch.Tensor:
    """`[H_kv, P, T]` bool: key j allowed for query p (selected block, or own block up to p)."""
    p_cnt, h_kv, _ = selected.shape
    key_block = torch.arange(t, device=selected.device) // b  # [T]
    own = ((key_block[None, :] == (positions // b)[:, None])
           & (torch.arange(t, device=selected.device)[None, :] <= positions[:, None]))
    n_blocks = (t + b - 1) // b
    chosen = torch.zeros(p_cnt, h_kv, n_blocks + 1, dtype=torch.bool, device=selected.device)
    chosen.scatter_(-1, torch.where(selected >= 0, selected.long(), n_blocks), True)
    sel = chosen[..., :n_blocks][..., key_block]  # [P, H_kv, T]
    return (sel | own[:, None, :]).permute(1, 0, 2)


def sparse_eval_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """transformers attention function: dense causal rows, then the sparse rows recomputed.

    query `[1, H_q, Tq, D]`, key/value `[1, H_kv, T, D]` (post-RoPE); Tq < T when the queries are the
    last Tq positions after a cached prefix. Returns (`[1, Tq, H_q, D]`, None).
    """
    ctx = module._sas_eval
    spec: SparseEvalSpec = ctx["spec"]
    if query.shape[0] != 1:
        raise ValueError("sparse evaluation runs one sequence at a time")
    h_q, t_q, t = query.shape[1], query.shape[2], key.shape[2]
    h_kv = key.shape[1]
    offset = t - t_q  # position of the first query
    layer = module.layer_idx
    start = max(spec.sparse_from, offset)
    if spec.kv_fp8 is not None:  # what an fp8 KV cache (scale 1) hands every reader
        key, value = key.to(spec.kv_fp8).to(key.dtype), value.to(spec.kv_fp8).to(value.dtype)
    if spec.selector == "dense" or layer < spec.first_sparse_layer or start >= t:
        return causal_sdpa(query, key, value, scaling).transpose(1, 2), None
    positions = torch.arange(start, t, device=query.device)
    rows = slice(start - offset, t_q)  # the sparse queries among the given ones
    g = h_q // h_kv
    n_p = positions.numel()
    q_post = query[0, :, rows].transpose(0, 1)  # [P, H_q, D]
    k_post = key[0].transpose(0, 1)  # [T, H_kv, D]
    # Only the oracle (its ranking) and recall need the [H_kv, G, P, T] logits; the attention itself runs as
    # SDPA with the selection as a boolean mask (fused on CPU: no logits tensor, ~2.5x the masked softmax).
    fused = ctx.get("fused", True)
    logits = None
    if spec.selector == "oracle" or ctx.get("recall") is not None or not fused:
        qs = query[0, :, rows].float().reshape(h_kv, g * n_p, -1)  # q head h*G+j belongs to kv head h
        logits = torch.bmm(qs, key[0].float().transpose(1, 2)).view(h_kv, g, n_p, t) * scaling
    selected = select_for_queries(
        spec, layer, q_post, k_post, positions, ctx["model_table"], ctx["gate_table"], logits=logits
    )
    if ctx.get("recall") is not None:
        _add_recall(ctx["recall"], layer, logits, selected, positions, spec.block_size)
    allowed = _sparse_rows_mask(selected, positions, t, spec.block_size)  # [H_kv, P, T]
    if fused:  # batch = kv head, heads = its G query heads, one shared K/V head each
        sparse = torch.nn.functional.scaled_dot_product_attention(
            query[0, :, rows].float().view(h_kv, g, n_p, -1), key[0, :, None].float(), value[0, :, None].float(),
            attn_mask=allowed[:, None], scale=scaling, enable_gqa=True).reshape(h_q, n_p, -1).to(query.dtype)
    else:
        logits.masked_fill_(~allowed[:, None], float("-inf"))
        probs = torch.softmax(logits, dim=-1).view(h_kv, g * n_p, t)
        sparse = torch.bmm(probs, value[0].float()).view(h_q, n_p, -1).to(query.dtype)
    if start == offset:  # every given query is sparse: no dense rows to keep
        out = sparse[None]
    else:
        out = causal_sdpa(query, key, value, scaling).clone()
        out[0, :, rows] = sparse
    if ctx.get("record") is not None:
        ctx["record"][layer] = selected
    return out.transpose(1, 2), None


def _add_recall(recall: dict, layer: int, logits, selected, positions, block_size: int) -> None:
    """Accumulate into `recall[layer]` = [mass the selection captured, mass the oracle's K blocks
    capture], both over every (query, kv head): block attention mass as `oracle_scores` defines it."""
    width = max(logits.shape[-1] // block_size, 1)
    mass = oracle_scores(logits, positions, block_size, width)  # [P, H_kv, M]
    cand = (torch.arange(width, device=mass.device)[None, :]
            < torch.div(positions, block_size, rounding_mode="floor")[:, None])
    mass = mass * cand[:, None, :]
    k = selected.shape[-1]
    captured = (mass.gather(-1, selected.long().clamp_min(0)) * (selected >= 0)).sum()
    best = mass.topk(min(k, width), dim=-1).values.sum() if k else mass.new_zeros(())
    acc = recall.setdefault(layer, [0.0, 0.0])
    acc[0] += float(captured)
    acc[1] += float(best)


@contextlib.contextmanager
def sparse_eval(model, spec: SparseEvalSpec, max_pos: Optional[int] = None, record: Optional[dict] = None,
                recall: Optional[dict] = None, fused: bool = True):
    """Within the block, `model(...)` runs SAS sparse attention per `spec`.

    record: optional dict filled with `{layer: selected [P, H_kv, K]}` of the last forward.
    recall: optional dict accumulating `{layer: [captured, best]}` over forwards: the dense attention
    mass (per kv head, max over its query heads) of the selected blocks, and of the oracle's K best
    blocks; captured / best is the selection's attention-mass recall (1 for the oracle).
    fused: the sparse rows attend through SDPA with the selection as a boolean mask; False: explicit masked
    logits and softmax (the same numbers within fp32 rounding, several times the memory traffic: a check).
    """
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, sparse_eval_attention)
    device = next(model.parameters()).device
    max_pos = max_pos or model.config.max_position_embeddings
    table = model_rope_table(model, max_pos, device)
    gate_table = None
    if spec.gates:
        from sas_backend.geometry import ModelGeometry, gate_rope_table

        dg = next(iter(spec.gates.values())).gate_dim
        gate_table = gate_rope_table(dg, ModelGeometry.from_hf_config(model.config), max_pos, device=device)
    attn_modules = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "q_proj")]
    for m in attn_modules:
        m._sas_eval = {"spec": spec, "model_table": table, "gate_table": gate_table, "record": record,
                       "recall": recall, "fused": fused}
    previous = model.config._attn_implementation
    model.set_attn_implementation(ATTN_NAME)
    try:
        yield model
    finally:
        model.set_attn_implementation(previous)
        for m in attn_modules:
            del m._sas_eval


ANCHOR_ATTN_NAME = "sas_prompt_anchors"


def _anchor_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Dense causal attention that also adds each kv head's block attention mass of its queries (summed over
    them) to `module._sas_anchor_mass[layer]` `[H_kv, T // b]`."""
    ctx = module._sas_anchor
    h_q, t_q, t = query.shape[1], query.shape[2], key.shape[2]
    h_kv = key.shape[1]
    qs = query[0].float().reshape(h_kv, (h_q // h_kv) * t_q, -1)
    logits = torch.bmm(qs, key[0].float().transpose(1, 2)).view(h_kv, h_q // h_kv, t_q, t) * scaling
    positions = torch.arange(t - t_q, t, device=query.device)
    b = ctx["block_size"]
    ctx["mass"][module.layer_idx] = oracle_scores(logits, positions, b, max(t // b, 1)).sum(0)  # [H_kv, T // b]
    return causal_sdpa(query, key, value, scaling).transpose(1, 2), None


@torch.no_grad()
def prompt_anchors(model, ids, cache, num_blocks: int, window: int = 1,
                   block_size: int = 64) -> Dict[int, torch.Tensor]:
    """Per layer and kv head, the `num_blocks` complete blocks the prompt's last `window` queries attend most:
    `{layer: [H_kv, num_blocks]}` int64 (fewer candidates: -1 padded), for `SparseEvalSpec.anchors`; with
    window 1, what the server's `--sas-prompt-anchors` picks (`ops.anchors`).

    ids: the prompt `[n]` (list or tensor); cache: its dense transformers cache (all n tokens), left exactly as
    given (the last `window` tokens are recomputed to get their queries, then their K/V restored). A block's
    mass is the dense softmax summed over its keys, max over the kv group's query heads (as the oracle ranks),
    summed over the window's queries; the
    candidates are the complete blocks before the last prompt token's block.
    """
    from transformers import AttentionInterface

    ids = torch.as_tensor(ids)
    n = ids.numel()
    window = max(1, min(window, n - 1))
    AttentionInterface.register(ANCHOR_ATTN_NAME, _anchor_attention)
    mass: Dict[int, torch.Tensor] = {}
    attn_modules = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "q_proj")]
    for m in attn_modules:
        m._sas_anchor = {"mass": mass, "block_size": block_size}
    previous = model.config._attn_implementation
    model.set_attn_implementation(ANCHOR_ATTN_NAME)
    saved = [(layer.keys[..., n - window:, :].clone(), layer.values[..., n - window:, :].clone())
             for layer in cache.layers]
    try:
        cache.crop(n - window)
        model(ids[None, n - window:], past_key_values=cache, use_cache=True, logits_to_keep=1)
        for layer, (k, v) in zip(cache.layers, saved):  # the prefill's own K/V, bit for bit
            layer.keys[..., n - window:, :] = k
            layer.values[..., n - window:, :] = v
    finally:
        model.set_attn_implementation(previous)
        for m in attn_modules:
            del m._sas_anchor
    n_cand = (n - 1) // block_size
    return {layer: top_anchors(blocks, n_cand, num_blocks).long() for layer, blocks in mass.items()}
