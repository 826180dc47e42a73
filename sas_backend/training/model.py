"""AttnGates attached to a transformers causal LM (Llama, Qwen2, Qwen3) for training.

`attach_gates(model, spec)` freezes the backbone, adds one trainable `AttnGate` per layer as
`model.model.layers[i].self_attn.attn_gate` (so the model's parameter names are the checkpoint's
tensor names) and switches the model to the training attention function registered under
`ATTN_NAME`. Per layer, that function:

1. undoes the model's RoPE on q/k with the model's own cos/sin table (as `sas_backend.hf.sparse_eval`
   and the serving backend do), giving the pre-RoPE q/k the gate reads;
2. scores the blocks (`scoring.score_gate`: `log g` over the previous blocks + Top-K threshold);
3. objective "lm" (SAS): attention = the gated sparse-scope attention
   `softmax(q K_S^T * scale + log g_S) V_S` (Triton kernel on CUDA, torch reference on CPU), so the
   next-token loss trains the gates through `log g`; q/k/v keep their autograd graph, which carries
   the loss gradient back through the residual stream to the earlier layers' gates;
   objective "distill": attention stays dense; the layer adds `KL(target || softmax_prev(s))` to
   the loss, target = the backbone's dense attention probabilities (no grad) pooled over each
   block's keys ("max", SeerAttention-R; or "mass", their sum: the oracle's attention mass), max
   over the G query heads of a kv group, renormalized over the previous blocks.

Inputs are fixed-length rows `[B, L]` without padding (no attention_mask; positions 0..L-1 per
row); the rows become packed sequences with `cu_seqlens = [0, L, 2L, ...]`.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Mapping, Optional, Tuple

import torch

from sas_backend.gate.module import AttnGate
from sas_backend.geometry import ARCHITECTURES, ModelGeometry, architecture_by_model_type, gate_rope_table
from sas_backend.hf.causal import causal_sdpa
from sas_backend.hf.sparse_eval import model_rope_table
from sas_backend.ops.rope import invert_rope
from sas_backend.training.packing import query_bounds, seq_bounds
from sas_backend.training.scoring import DEFAULT_QUERY_CHUNK, candidate_blocks, check_forced, score_gate

ATTN_NAME = "sas_gate_train"
OBJECTIVES = ("lm", "distill")
KERNELS = ("auto", "triton", "naive")
# Training scope (the paper's gating ablation): "sparse" keeps only the Top-K blocks per query (a
# threshold on log g, the fused kernel's regime); "full" keeps every previous block with its soft gate
# (dense cost), so every block gets a ranking signal from the first step.
SCOPES = ("sparse", "full")
# Distill targets: a block's dense attention probabilities pooled by their max (SeerAttention-R) or
# their sum ("mass": the quantity the oracle selector ranks by and the harness's recall measures).
DISTILL_TARGETS = ("max", "mass")
# Distill targets are built from dense attention rows in chunks of at most this many fp32 logits.
_DENSE_CHUNK_ELEMS = 1 << 26


class UnsupportedModelError(ValueError):
    """The model is not a causal LM this trainer knows how to gate (see `geometry.ARCHITECTURES`)."""


@dataclasses.dataclass
class GateTrainSpec:
    """How the gates train.

    block_size b; budget B tokens of previous blocks per query, so K = B // b previous blocks are
    selected besides the query's own (the serving rule: a gate trained at B is served with
    `--sas-budget B` and sees the same K); objective "lm" (SAS) or "distill"; scope (lm only)
    "sparse" (the Top-K blocks by log g) or "full" (every previous block, soft-gated; see SCOPES); kernel
    "auto" (Triton on CUDA, torch reference on CPU), "triton" or "naive"; query_chunk: queries scored at a
    time (memory bound).
    train_last: None trains every position of a row; N trains only the last N positions: the
    first L - N run dense without gradient (as after a dense prefill, the serving regime) and
    their K/V are the keys of the N gated queries. Far cheaper per trained query at long L
    (the torch reference then materializes `[Hq, N, L]`, not `[Hq, L, L]`); the Triton kernel
    covers full rows only, so "auto" picks the reference.
    sink_blocks/local_blocks: blocks forced inside K as the server forces them
    (`--sas-sink-blocks/--sas-local-blocks`); the gate ranks only the others (lm: forced blocks are
    attended unbiased; distill: the target is renormalized over the other blocks). See `scoring`.
    """

    block_size: int = 64
    budget: int = 512
    objective: str = "lm"
    scope: str = "sparse"
    kernel: str = "auto"
    query_chunk: int = DEFAULT_QUERY_CHUNK
    train_last: Optional[int] = None
    distill_target: str = "max"
    sink_blocks: int = 0
    local_blocks: int = 0

    def __post_init__(self):
        if self.distill_target not in DISTILL_TARGETS:
            raise ValueError(f"distill_target must be one of {DISTILL_TARGETS}, got {self.distill_target!r}")
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {OBJECTIVES}, got {self.objective!r}")
        if self.scope not in SCOPES:
            raise ValueError(f"scope must be one of {SCOPES}, got {self.scope!r}")
        if self.kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, got {self.kernel!r}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.train_last is not None and self.train_last < 2:
            raise ValueError(f"train_last must be >= 2 (one next-token prediction inside the tail) or None "
                             f"for whole rows, got {self.train_last}")
        if self.train_last is not None and self.kernel == "triton":
            raise ValueError("the Triton kernel trains whole rows; train_last runs the torch reference "
                             "(kernel 'naive' or 'auto')")
        if self.budget < self.block_size or self.budget % self.block_size:
            raise ValueError(
                f"budget {self.budget} must be a positive multiple of the block size {self.block_size} "
                "(it is spent in whole blocks, as in serving)"
            )
        check_forced(self.top_k, self.sink_blocks, self.local_blocks)

    @property
    def top_k(self) -> int:
        """K previous blocks per query besides its own: budget // block_size (the serving rule)."""
        return self.budget // self.block_size


def check_supported(model) -> None:
    """Raise UnsupportedModelError unless `model` is a causal LM whose `model_type`
    `geometry.ARCHITECTURES` marks as trainable."""
    cfg = getattr(model, "config", None)
    mtype = getattr(cfg, "model_type", None)
    support = architecture_by_model_type(mtype)
    if support is None or not support.train:
        trained = [a for a in ARCHITECTURES.values() if a.train]
        msg = (f"gate training supports model types {', '.join(a.model_type for a in trained)} "
               f"({', '.join(a.family for a in trained)} families)")
        if support is None:
            raise UnsupportedModelError(f"{msg}; this model is {mtype!r} ({type(model).__name__})")
        raise UnsupportedModelError(
            f"gate training does not support {support.family} ({mtype}), which the backend "
            f"{'serves' if support.serve else 'does not serve either'}: {support.train_refusal}; {msg}"
        )
    if getattr(cfg, "use_sliding_window", False) or (getattr(cfg, "layer_types", None) and any(
            t != "full_attention" for t in cfg.layer_types)):
        raise UnsupportedModelError(
            f"{mtype} model uses sliding-window attention layers; gate training needs full attention"
        )
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(inner, "rotary_emb"):
        raise UnsupportedModelError(
            f"{type(model).__name__} is not a causal-LM wrapper (expected .model.layers and .model.rotary_emb)"
        )


def attention_modules(model) -> List[torch.nn.Module]:
    """The `self_attn` module of every decoder layer, in layer order."""
    return [layer.self_attn for layer in model.model.layers]


def resolve_kernel(kernel: str, device: torch.device, train_last: Optional[int] = None) -> str:
    """"triton" or "naive" for `kernel` on `device`; refuses Triton where it cannot run."""
    import os

    if kernel == "auto":
        return "triton" if device.type == "cuda" and train_last is None else "naive"
    if kernel == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("--kernel triton needs a CUDA device (or TRITON_INTERPRET=1 to run it on CPU, slowly)")
    return kernel


def gated_attention_op(q, k, v, log_g, threshold, cu_seqlens, block_size: int, scale: float, kernel: str,
                       query_start: int = 0):
    """Dispatch to the fused Triton kernel or the torch reference (same signature and result).

    q `[Tq, Hq, D]`, k/v `[T, Hkv, D]`, log_g `[Hkv, Tq, NB]`, threshold `[Hkv, Tq]`. Returns
    `[Tq, Hq, D]`. Tq = T unless query_start > 0 (torch reference only, see gated_attention_naive).
    """
    from sas_backend.training.ops.gated_attention import gated_attention, gated_attention_naive

    if kernel == "triton":
        if query_start:
            raise ValueError("the Triton gated kernel covers whole rows (query_start 0); use the reference")
        return gated_attention(q, k, v, log_g, threshold, cu_seqlens, block_size, scale)
    return gated_attention_naive(q, k, v, log_g, threshold, cu_seqlens, block_size, scale, query_start)


class _TrainContext:
    """Shared per-model state the attention function reads (one object, referenced by every layer)."""

    def __init__(self, spec: GateTrainSpec, kernel: str, model_table, gate_table):
        self.spec = spec
        self.kernel = kernel
        self.model_table = model_table  # [max_pos, D] the model's cos|sin (to undo its RoPE)
        self.gate_table = gate_table  # [max_pos, Dg] the gate's RoPE table
        self.aux_losses: List[torch.Tensor] = []  # distill: one KL per layer of the last forward
        self.dense_pass = False  # True while the no-grad dense prefix of train_last runs


def pooled_attention_target(q, k, bounds, block_size, num_blocks, scale, query_start: int = 0,
                            pool: str = "max") -> torch.Tensor:
    """Distill target `[Hkv, Tq, NB]` (no grad): dense causal attention probabilities pooled over
    each block's keys (pool "max", or "mass": their sum, as `hf.sparse_eval.oracle_scores`), max over
    the G query heads of a group, renormalized over previous blocks.

    q `[Tq, Hq, D]` (the positions >= query_start of each sequence, packed), k `[T, Hkv, D]`
    post-RoPE. Rows without a previous block are all zero. Dense rows are built a chunk of queries
    at a time (memory O(Hq * chunk * L)).
    """
    t, h_q, _ = q.shape
    h_kv = k.shape[1]
    g = h_q // h_kv
    out = q.new_zeros(h_kv, t, num_blocks, dtype=torch.float32)
    for (bos, eos), (qbos, qeos) in zip(bounds, query_bounds(bounds, query_start)):
        n = eos - bos
        full = n // block_size
        if full == 0 or qeos == qbos:
            continue
        ks = k[bos:eos].float().transpose(0, 1).repeat_interleave(g, 0)  # [Hq, L, D]
        chunk = max(1, min(n, _DENSE_CHUNK_ELEMS // max(1, h_q * n)))
        for c0 in range(query_start, n, chunk):
            c1 = min(n, c0 + chunk)
            r0, r1 = qbos + c0 - query_start, qbos + c1 - query_start  # rows of these queries in q
            qs = q[r0:r1].float().transpose(0, 1)  # [Hq, C, D]
            logits = torch.einsum("hcd,hld->hcl", qs, ks) * scale
            pos = torch.arange(c0, c1, device=q.device)
            causal = torch.arange(n, device=q.device)[None, :] <= pos[:, None]
            probs = torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1)
            blocks = probs[..., : full * block_size].reshape(h_q, c1 - c0, full, block_size)
            pooled = blocks.sum(-1) if pool == "mass" else blocks.amax(-1)
            pooled = pooled.reshape(h_kv, g, c1 - c0, full).amax(1)  # [Hkv, C, full]
            valid = torch.arange(full, device=q.device)[None, :] < (pos // block_size)[:, None]
            pooled = pooled * valid
            denom = pooled.sum(-1, keepdim=True)
            out[:, r0:r1, :full] = torch.where(denom > 0, pooled / denom.clamp_min(1e-30), 0.0)
    return out


def target_over_candidates(target: torch.Tensor, pos: torch.Tensor, block_size: int, sink_blocks: int,
                           local_blocks: int) -> torch.Tensor:
    """The distill target `[Hkv, T, NB]` restricted to the blocks the gate ranks (forced sink/local
    blocks are attended anyway) and renormalized; unchanged without forced blocks. pos `[T]`: each
    query's in-sequence position."""
    if not (sink_blocks or local_blocks):
        return target
    cand, _ = candidate_blocks(pos, target.shape[-1], block_size, sink_blocks, local_blocks)
    target = target * cand[None]
    return target / target.sum(-1, keepdim=True).clamp_min(1e-30)


def distill_kl(target: torch.Tensor, log_g: torch.Tensor) -> torch.Tensor:
    """Mean over queries with previous blocks of KL(target || exp(log_g)), both `[Hkv, T, NB]`."""
    has_prev = target.sum(-1) > 0  # [Hkv, T]
    safe_lg = torch.where(target > 0, log_g, torch.zeros_like(log_g))  # avoid 0 * -inf
    kl = (torch.xlogy(target, target) - target * safe_lg).sum(-1)  # [Hkv, T]
    return kl.sum() / has_prev.sum().clamp_min(1)


def per_query_coverage(target: torch.Tensor, log_g: torch.Tensor, cand: torch.Tensor, k: int,
                       temperature: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """(coverage `[Hkv, T]`, has_prev `[Hkv, T]` bool): each query's target mass inside the gate's top k,
    as `topk_coverage` (same arguments) before its mean over the queries with previous blocks."""
    nb = log_g.shape[-1]
    has_prev = target.sum(-1) > 0  # [Hkv, T]
    if k >= nb:
        return has_prev.float(), has_prev
    masked = log_g.masked_fill(~cand[None], float("-inf"))
    top = torch.topk(masked, k + 1, dim=-1).values  # [Hkv, T, k+1]
    keep_all = (cand.sum(-1) <= k)[None].expand_as(has_prev)
    if temperature <= 0:  # exactly k blocks, ties to the lower block index (the serving rule)
        chosen = torch.sort(masked, dim=-1, descending=True, stable=True).indices[..., :k]
        cov = torch.gather(target, -1, chosen).sum(-1)
        return torch.where(keep_all, target.sum(-1), cov), has_prev
    tau = torch.where(keep_all, torch.zeros_like(top[..., 0]), (top[..., k - 1] + top[..., k]) / 2)
    soft = torch.sigmoid((log_g - tau[..., None]) / temperature)
    return (target * torch.where(keep_all[..., None], torch.ones_like(soft), soft)).sum(-1), has_prev


def topk_coverage(target: torch.Tensor, log_g: torch.Tensor, cand: torch.Tensor, k: int,
                  temperature: float = 0.0) -> torch.Tensor:
    """Mean over queries with previous blocks of the target mass inside the gate's top-k candidates.

    target, log_g `[Hkv, T, NB]` (target zero outside the candidates, as `target_over_candidates`
    leaves it); cand `[T, NB]` bool: the blocks the gate ranks. temperature 0: the hard top-k (what
    serving selects; no gradient). temperature t > 0: each candidate counts
    `sigmoid((log_g - tau) / t)`, tau midway between the k-th and (k+1)-th largest candidate log_g,
    so the gradient reaches the blocks near the selection boundary, the ones a budget decides on.
    Queries with at most k candidates keep everything (coverage 1).
    """
    cov, has_prev = per_query_coverage(target, log_g, cand, k, temperature)
    return (cov * has_prev).sum() / has_prev.sum().clamp_min(1)


def oracle_topk_mass(target: torch.Tensor, k: int) -> torch.Tensor:
    """`[Hkv, T]`: each query's target mass in its k heaviest blocks, the most any selection of k
    covers (the oracle's coverage). target `[Hkv, T, NB]` zero outside the ranked candidates, as
    `target_over_candidates` leaves it; a query with at most k candidates keeps all its mass."""
    return torch.topk(target, min(k, target.shape[-1]), dim=-1).values.sum(-1)


def topk_regret(target: torch.Tensor, log_g: torch.Tensor, cand: torch.Tensor, k: int,
                temperature: float = 0.0) -> torch.Tensor:
    """Mean over queries with previous blocks of the squared regret `(best - coverage)^2`: best is the
    target mass of the target's own k heaviest candidates (the oracle), coverage the gate's as in
    `topk_coverage` (same shapes and temperature). Squaring puts the gradient on the queries whose
    selection misses the most, where a sparse step loses its perplexity; a mean coverage term spreads
    it over every query alike."""
    cov, has_prev = per_query_coverage(target, log_g, cand, k, temperature)
    regret = (oracle_topk_mass(target, k) - cov).clamp_min(0)
    return (regret.square() * has_prev).sum() / has_prev.sum().clamp_min(1)


def training_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """transformers attention function for gate training (registered as `ATTN_NAME`).

    query `[B, Hq, Lq, D]`, key/value `[B, Hkv, L, D]` post-RoPE; Lq < L when the queries are the
    last Lq positions after a cached dense prefix (`GateTrainSpec.train_last`).
    Returns (`[B, Lq, Hq, D]`, None).
    """
    ctx: _TrainContext = module._sas_train
    spec = ctx.spec
    if ctx.dense_pass:  # the no-grad dense prefix of train_last
        return causal_sdpa(query, key, value, scaling).transpose(1, 2), None
    bsz, h_q, q_len, d = query.shape
    h_kv, seqlen = key.shape[1], key.shape[2]
    # With a cached prefix (train_last) transformers passes its causal mask; the tail's positions
    # are known, so it is not needed. On whole rows a mask would mean padding, which is unsupported.
    if attention_mask is not None and q_len == seqlen:
        raise ValueError(
            "gate training runs unpadded fixed-length rows: call the model without attention_mask "
            "(positions 0..L-1 per row)"
        )
    q_start = seqlen - q_len  # in-row position of the first query (0: whole rows)
    q = query.transpose(1, 2).reshape(bsz * q_len, h_q, d)
    k = key.transpose(1, 2).reshape(bsz * seqlen, h_kv, d)
    v = value.transpose(1, 2).reshape(bsz * seqlen, h_kv, d)
    if seqlen > ctx.model_table.shape[0]:
        raise ValueError(f"sequence length {seqlen} exceeds the RoPE table ({ctx.model_table.shape[0]} positions)")
    cu = torch.arange(bsz + 1, device=query.device, dtype=torch.int32) * seqlen
    q_pre = invert_rope(q.detach(), ctx.model_table[q_start:seqlen].repeat(bsz, 1))  # the gate's inputs
    k_pre = invert_rope(k.detach(), ctx.model_table[:seqlen].repeat(bsz, 1))
    scores = score_gate(
        module.attn_gate, q_pre, k_pre, cu, spec.block_size, spec.top_k, ctx.gate_table,
        query_chunk=spec.query_chunk, query_start=q_start,
        sink_blocks=spec.sink_blocks, local_blocks=spec.local_blocks,
    )
    if spec.objective == "lm":
        # Full scope: a -inf threshold keeps every previous block, each biased by its log g.
        threshold = scores.threshold if spec.scope == "sparse" else torch.full_like(scores.threshold, float("-inf"))
        out = gated_attention_op(q, k, v, scores.log_g, threshold, cu, spec.block_size,
                                 scaling, ctx.kernel, q_start)
        return out.view(bsz, q_len, h_q, d), None
    # distill: dense attention for the forward, KL on the side (target carries no gradient)
    with torch.no_grad():
        target = pooled_attention_target(q, k, seq_bounds(cu), spec.block_size, scores.num_blocks, scaling,
                                         q_start, spec.distill_target)
        pos = torch.arange(q_start, seqlen, device=q.device).repeat(bsz)
        target = target_over_candidates(target, pos, spec.block_size, spec.sink_blocks, spec.local_blocks)
    ctx.aux_losses.append(distill_kl(target, scores.log_g))
    return causal_sdpa(query, key, value, scaling).transpose(1, 2), None


def attach_gates(
    model,
    spec: GateTrainSpec,
    gates: Optional[Mapping[int, object]] = None,
    *,
    gate_dim: int = 128,
    max_pos: Optional[int] = None,
) -> Dict[int, AttnGate]:
    """Freeze `model`, attach one trainable fp32 AttnGate per layer and switch to the training
    attention. Returns `{layer: AttnGate}`.

    gates: `{layer: AttnGate or state dict}` (e.g. from `init_gate_state` / `load_gate_checkpoint`)
    for every layer; None keeps AttnGate's default init. max_pos: RoPE table length (default the
    model's max_position_embeddings).
    """
    from transformers import AttentionInterface

    check_supported(model)
    geo = ModelGeometry.from_hf_config(model.config)
    device = next(model.parameters()).device
    kernel = resolve_kernel(spec.kernel, device, spec.train_last)
    if kernel == "triton" and (spec.block_size < 16 or spec.block_size & (spec.block_size - 1)):
        raise ValueError(f"the Triton kernel needs a block size that is a power of two >= 16, got {spec.block_size}")
    modules = attention_modules(model)
    if gates is not None:
        missing = [i for i in range(len(modules)) if i not in gates]
        if missing:
            raise ValueError(f"gates given for layers {sorted(gates)[:4]}..., missing layers {missing[:8]}")
        first = gates[0]
        if isinstance(first, AttnGate):
            gate_dim = first.gate_dim
        else:
            gate_dim = int(first["attngate_linear_q.weight"].shape[-1])
    model.requires_grad_(False)
    max_pos = max_pos or geo.max_position_embeddings or 8192
    ctx = _TrainContext(
        spec, kernel,
        model_rope_table(model, max_pos, device),
        gate_rope_table(gate_dim, geo, max_pos, device),
    )
    out: Dict[int, AttnGate] = {}
    for i, attn in enumerate(modules):
        gate = AttnGate(geo.num_kv_heads, geo.group_size, geo.head_dim, gate_dim)
        if gates is not None:
            src = gates[i]
            state = src.state_dict() if isinstance(src, torch.nn.Module) else src
            gate.load_state_dict({n: t.float() for n, t in state.items()})
        gate = gate.to(device=device, dtype=torch.float32).requires_grad_(True)
        attn.attn_gate = gate  # submodule: parameter names = checkpoint tensor names
        attn._sas_train = ctx
        out[i] = gate
    AttentionInterface.register(ATTN_NAME, training_attention)
    model._sas_previous_attn = model.config._attn_implementation
    model.set_attn_implementation(ATTN_NAME)
    return out


def detach_gates(model) -> Dict[int, AttnGate]:
    """Undo `attach_gates`: remove the gates, restore the attention implementation. Returns the gates
    (the backbone stays frozen)."""
    gates = {}
    for i, attn in enumerate(attention_modules(model)):
        if hasattr(attn, "attn_gate"):
            gates[i] = attn.attn_gate
            del attn.attn_gate
        if hasattr(attn, "_sas_train"):
            del attn._sas_train
    previous = getattr(model, "_sas_previous_attn", None)
    if previous is not None:
        model.set_attn_implementation(previous)
        del model._sas_previous_attn
    return gates


def gates_of(model) -> Dict[int, AttnGate]:
    """`{layer: AttnGate}` currently attached to `model`."""
    return {i: a.attn_gate for i, a in enumerate(attention_modules(model)) if hasattr(a, "attn_gate")}


def gate_parameters(model) -> List[torch.nn.Parameter]:
    """The trainable parameters (all gates' tensors), in layer order."""
    return [p for g in gates_of(model).values() for p in g.parameters()]


def _context(model) -> _TrainContext:
    mods = attention_modules(model)
    if not mods or not hasattr(mods[0], "_sas_train"):
        raise ValueError("no gates attached: call attach_gates(model, spec) first")
    return mods[0]._sas_train


def objective_loss(model, input_ids: torch.Tensor, runner=None) -> torch.Tensor:
    """The training loss of one batch `[B, L]` for the attached spec's objective (a scalar).

    lm: mean next-token cross-entropy of the gated model. distill: sum over layers of the mean
    per-query KL. runner: what to call for the forward (a DDP wrapper of `model`); default `model`.
    With `spec.train_last = N` the first L - N tokens run dense without gradient into a KV cache and
    only the last N are gated queries (lm: the loss of their N - 1 next-token predictions).
    """
    ctx = _context(model)
    runner = model if runner is None else runner
    ctx.aux_losses = []
    cache = None
    n_last = ctx.spec.train_last
    if n_last is not None:
        if n_last >= input_ids.shape[1]:
            raise ValueError(f"train_last {n_last} must be smaller than the row length {input_ids.shape[1]}")
        prefix, input_ids = input_ids[:, :-n_last], input_ids[:, -n_last:]
        ctx.dense_pass = True
        try:
            with torch.no_grad():
                cache = runner(input_ids=prefix, use_cache=True, logits_to_keep=1).past_key_values
        finally:
            ctx.dense_pass = False
    extra = {"past_key_values": cache, "use_cache": True} if cache is not None else {"use_cache": False}
    if ctx.spec.objective == "lm":
        return runner(input_ids=input_ids, labels=input_ids, **extra).loss
    runner(input_ids=input_ids, logits_to_keep=1, **extra)  # the LM head is not needed
    losses, ctx.aux_losses = ctx.aux_losses, []
    if not losses:
        raise RuntimeError("distill forward produced no layer losses")
    return torch.stack(losses).sum()
