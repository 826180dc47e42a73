"""An independent oracle for the server's sparse decode, with the selection rule written out here.

The default model in transformers (fp32, its own forward, its own K/V and RoPE), run over the prompt and the
server's tokens, with the attention of every decode position replaced by attention over the blocks that
DESIGN.md's selection rule picks at that position. The rule is stated below, short and plain, from DESIGN.md
("The selector (AttnGate)", "Selection semantics at decode"; the training-free selectors and prompt anchors,
which DESIGN.md leaves open, from docs/design.md's "Selection semantics" and "Selectors"); nothing of sas_backend is
imported (no selector, op, gate module or RoPE table of the code under test): the gate's tensors are read from
its gate.safetensors with safetensors, the model is plain transformers, the rest is torch. A selection bug in
sas_backend therefore shows up as a difference here instead of being shared.

The rule, per layer, request and kv head h, for the query at position p (block size b, budget B):
- candidates: the n = p // b complete blocks before the query's own block; K = B // b of them are attended,
  plus the own block up to p (causal). With n <= K every candidate is attended (dense).
- forced blocks count inside K: the first `sink` blocks, then the `local` blocks right before the own block;
  then the prompt anchors (below); the remaining places go to the highest scores, ties to the lower block.
- gate score: s[h, m] = qg[h] . kg[h, m] / sqrt(Dg), where
  qg[h] = RoPE_p(RMSNorm_qnorm(sum_{g,i} q_pre[h*G+g, i] * Wq[h, g, i, :])) from the query before RoPE, and
  kg[h, m] = RoPE_{m*b}(RMSNorm_knorm(cat(max, min, mean over the block's b pre-RoPE keys) @ Wk[h])),
  RMSNorm in fp32 with eps 1e-6, RoPE the model's formula and theta on Dg dims, at the block's FIRST position.
- quest (training-free): s[h, m] = max over the G query heads of sum_d max(q_d * min_d, q_d * max_d), q and the
  block's key min / max after the model's RoPE (an upper bound of q.k over the block).
- sub-block summaries (--sas-sub-blocks N, gate and quest; docs/design.md): block m's N runs of b / N tokens are
  each scored as above as if a block of b / N tokens (the gate's pooling over the run, RoPE at the run's first
  position m*b + j*b/N; quest's min / max over the run), and s[h, m] is the largest of its runs' scores.
- sink-local (training-free): sink = sink blocks or 1, local = K - sink; no scores.
- prompt anchors (--sas-prompt-anchors R): at the prompt's last token (position L - 1), per kv head, the R
  complete blocks before that token's block with the most attention mass: its dense causal softmax summed over
  each block's keys, max over the G query heads; highest first, ties to the lower block. Forced at every decode
  step of the request, after the sink and local blocks.
The attention itself is plain softmax(q K_S^T * scale) V_S over the selected blocks and the own block.
- fp8 KV cache (--kv-cache-dtype fp8_e4m3, SGLang's contract): the cache holds fp8(K / s_l) and fp8(V / s_l) with
  the layer's scale s_l (1.0 without --quantization-param-path), so every reader of K and V, the dense prefill
  included, sees fp8(K / s_l) * s_l; the gate pools those keys with the model's RoPE undone (RoPE at -position).
A check may have the oracle attend the server's own selections (`Rule.follow`, from its debug log) while it
still computes, reports and scores its own: where fp8 roundings flip near-tie selections, the check then asks
whether the server's picks are near ties of the oracle's scores instead of compounding the flip.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import pathlib
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch

from tests.server.compare import FP32, Decode

# The server runs fp32 on CPU (the same math as the oracle up to summation order): compare.FP32's tolerance (1e-4;
# measured 2026-12-01 against this oracle, largest |dlogprob| of a step, two runs: gate 2.2e-6, gate + anchors 2.6e-6,
# quest 2.4e-6 / 7.9e-6, sink-local 6.9e-6 / 3.4e-6, where sparse and dense differ by 0.26 to 1.2). bf16 on GPU: 0.15,
# as before, not re-measured.
LOGPROB_TOL = 0.15 if torch.cuda.is_available() else FP32.logprob
GATE_NORM_EPS = 1e-6
ORACLE_ATTN = "sas_test_oracle"


Scale = Union[float, Sequence[float]]  # an fp8 KV scale: one, or one a kv head


def _per_head(scale: Scale) -> torch.Tensor:
    """`scale` shaped to divide or multiply K / V `[1, H_kv, T, D]`."""
    return torch.tensor(scale, dtype=torch.float32).reshape(1, -1, 1, 1)


@dataclasses.dataclass(frozen=True)
class Rule:
    """What the server under test was launched with: --sas-budget (K = budget // b), --sas-selector,
    --sas-gate (a canonical checkpoint directory), --sas-sink-blocks, --sas-local-blocks, --sas-prompt-anchors,
    --sas-sub-blocks, --sas-exact-rerank.
    sparse_from: the first sparse query position (the prompt length: the prefill is dense)."""

    budget: int
    sparse_from: int
    selector: str = "gate"
    gate: Optional[pathlib.Path] = None
    sink_blocks: int = 0
    local_blocks: int = 0
    prompt_anchors: int = 0
    block_size: int = 64
    sub_blocks: int = 1
    exact_rerank: int = 1  # X > 1: the selector picks X x K blocks, the K of most attention mass among them are kept
    rerank_keys: str = "kv"  # "int4": that second level reads each block's keys at 4 bits (`_four_bit`)
    kv_fp8: Optional[torch.dtype] = None  # the fp8 dtype of the KV cache (None: the model's dtype)
    # per layer: s or (k_s, v_s), each a float or one a kv head (tensor parallelism: a rank's own); None: 1.0
    kv_scales: Optional[Dict[int, Union[float, Tuple[Scale, Scale]]]] = None
    kv_scales_read: bool = True  # False: a reader that drops the scales (fp8(K / s) taken as K), a negative control
    kv_scales_crossed: bool = False  # True: a reader that takes V's scale for K and K's for V, a negative control
    # `{layer: {position: [H_kv][K]}}`: blocks the oracle attends there in place of its own picks (the server's, from
    # its debug log), so that a check sees fp8's roundings apart from the selection flips they cause; its own picks
    # still land in OracleRun.selected, their scores in OracleRun.scores.
    follow: Optional[Dict[int, Dict[int, List[List[int]]]]] = None

    @property
    def top_k(self) -> int:
        return self.budget // self.block_size

    def forced(self):
        """(sink, local) forced block counts."""
        if self.selector == "sink-local":
            sink = min(self.sink_blocks or 1, self.top_k)
            return sink, self.top_k - sink
        return self.sink_blocks, self.local_blocks


def select(rule: Rule, n: int, scores: Optional[List[float]] = None, anchors=(), k: Optional[int] = None) -> List[int]:
    """The blocks attended (ascending) among n candidates, given their scores and the request's anchors (k blocks;
    None: the rule's K)."""
    k = rule.top_k if k is None else k
    if n <= k:
        return list(range(n))
    sink, local = rule.forced()
    chosen = list(range(min(sink, n)))
    chosen += [m for m in range(n - local, n) if m not in chosen]
    chosen += [m for m in anchors if 0 <= m < n and m not in chosen]
    assert len(chosen) <= k, f"{len(chosen)} forced blocks do not fit K = {k}"
    rest = sorted((m for m in range(n) if m not in chosen), key=lambda m: (-scores[m], m))
    return sorted(chosen + rest[: k - len(chosen)])


def _four_bit(keys: torch.Tensor) -> torch.Tensor:
    """`--sas-rerank-keys int4` stated: a block's keys `[b, D]` per channel at 4 bits, lo = its min in fp16, step =
    (max - lo) / 15 in fp16, code = floor((key - lo) / step + 1/2) clamped to 0..15 (0 for a constant channel), read
    back as lo + step * code (all in fp32 but the two fp16 roundings)."""
    lo = keys.amin(0).half().float()
    step = ((keys.amax(0) - lo) / 15.0).half().float()
    code = torch.where(step > 0, torch.floor((keys - lo) / torch.where(step > 0, step, 1.0) + 0.5).clamp(0, 15), 0.0)
    return lo + step * code


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """x `[..., N, d]` rotated at `positions` `[N]`: the Llama/Qwen (neox, rotate-half) formula in fp32,
    inv_freq = 1 / theta^(2i / d), as transformers' default rotary embedding computes it."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    angles = positions.float()[:, None] * inv_freq[None, :]
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + GATE_NORM_EPS) * weight.float()


def load_gate(gate_dir: pathlib.Path) -> Dict[int, Dict[str, torch.Tensor]]:
    """`{layer: {"q": [H_kv, G, D, Dg], "k": [H_kv, 3D, Dg], "qnorm": [Dg], "knorm": [Dg]}}` fp32 from a canonical
    checkpoint (DESIGN.md, "Gate checkpoints")."""
    from safetensors.torch import load_file

    cfg = json.loads((pathlib.Path(gate_dir) / "config.json").read_text())
    assert cfg["seerattn_q_head_pooling_type"] == "Qproj" and cfg["seerattn_k_seq_pooling_type"] == "Kmaxminavg"
    tensors = load_file(str(pathlib.Path(gate_dir) / "gate.safetensors"))
    names = {"q": "attngate_linear_q", "k": "attngate_linear_k", "qnorm": "attngate_qnorm", "knorm": "attngate_knorm"}
    return {i: {short: tensors[f"model.layers.{i}.self_attn.attn_gate.{name}.weight"].float()
                for short, name in names.items()}
            for i in range(cfg["num_hidden_layers"])}


def gate_scores(w, q_pre: torch.Tensor, positions: torch.Tensor, k_pre: torch.Tensor, n: int, b: int,
                theta: float) -> torch.Tensor:
    """`[P, H_kv, n]` gate scores of the queries q_pre `[P, H_q, D]` at `positions` `[P]` over the first n blocks
    of k_pre `[T, H_kv, D]`."""
    h_kv, g, d, dg = w["q"].shape
    proj = torch.einsum("phi,hio->hpo", q_pre.float().reshape(-1, h_kv, g * d), w["q"].reshape(h_kv, g * d, dg))
    qg = rope(rms_norm(proj, w["qnorm"]), positions, theta)  # [H_kv, P, Dg]
    blocks = k_pre[: n * b].float().unflatten(0, (n, b))  # [n, b, H_kv, D]
    pooled = torch.cat([blocks.amax(1), blocks.amin(1), blocks.mean(1)], -1)  # [n, H_kv, 3D]
    kg = rms_norm(torch.einsum("nhi,hio->hno", pooled, w["k"]), w["knorm"])  # [H_kv, n, Dg]
    kg = rope(kg, torch.arange(n) * b, theta)  # at each block's first position
    return torch.einsum("hpo,hno->phn", qg, kg) / math.sqrt(dg)


def quest_scores(q_post: torch.Tensor, k_post: torch.Tensor, n: int, b: int) -> torch.Tensor:
    """`[P, H_kv, n]` Quest bounds of the queries q_post `[P, H_q, D]` over the first n blocks of k_post
    `[T, H_kv, D]`."""
    h_kv, d = k_post.shape[1], k_post.shape[2]
    blocks = k_post[: n * b].float().unflatten(0, (n, b))
    kmin, kmax = blocks.amin(1).transpose(0, 1), blocks.amax(1).transpose(0, 1)  # [H_kv, n, D]
    q = q_post.float().view(q_post.shape[0], h_kv, -1, 1, d)  # [P, H_kv, G, 1, D]
    return torch.maximum(q * kmin[:, None], q * kmax[:, None]).sum(-1).amax(2)  # [P, H_kv, n]


def anchors_at(q_post: torch.Tensor, k_post: torch.Tensor, scale: float, b: int, count: int) -> List[List[int]]:
    """The prompt anchors `[H_kv][count]` of the prompt's last query q_post `[H_q, D]` over its keys k_post
    `[L, H_kv, D]` (its own key last)."""
    t, h_kv, d = k_post.shape
    probs = torch.softmax(torch.einsum("hgd,thd->hgt", q_post.float().view(h_kv, -1, d), k_post.float()) * scale, -1)
    n_blocks, n = t // b, (t - 1) // b
    mass = probs[..., : n_blocks * b].unflatten(-1, (n_blocks, b)).sum(-1).amax(1)  # [H_kv, n_blocks]
    return [sorted(range(n), key=lambda m: (-mass[h, m].item(), m))[:count] for h in range(h_kv)]


class TailRows:
    """Rows `first..T-1` of a `[T, V]` logprobs tensor, indexed by absolute position: `rows[pos]`, `rows[pos, tok]`
    (the rows before `first` are not computed: no check reads them)."""

    def __init__(self, rows: torch.Tensor, first: int):
        self.rows, self.first = rows, first

    def __getitem__(self, index):
        pos, *rest = index if isinstance(index, tuple) else (index,)
        if not self.first <= pos < self.first + len(self.rows):
            raise IndexError(f"position {pos}: the oracle kept rows {self.first}..{self.first + len(self.rows) - 1}")
        return self.rows[(pos - self.first, *rest)]


@dataclasses.dataclass
class OracleRun:
    """logprobs `[T, V]` (`TailRows`) of the sparse (rule) and the dense forward over prompt + tokens;
    selected `{layer: {position: [H_kv][K]}}`; anchors `{layer: [H_kv][R]}`; scores `{layer: [P, H_kv, n]}`, the
    selector's scores of the n complete blocks at positions sparse_from.. (gate and quest; a position's candidates
    are its first p // b)."""

    sparse_logprobs: torch.Tensor
    dense_logprobs: torch.Tensor
    selected: Dict[int, Dict[int, List[List[int]]]]
    anchors: Dict[int, List[List[int]]]
    scores: Dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)


@functools.lru_cache(maxsize=1)  # a test module asks the oracle about one model several times
def _fp32_model(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def run_oracle(model_dir, rule: Rule, prompt: List[int], tokens: List[int]) -> OracleRun:
    """The oracle's forwards over `prompt + tokens`: position len(prompt) - 1 + i is where the server chose
    tokens[i]; the last position is the step SGLang's overlap scheduler runs past the last token (its output is
    dropped, its selection logged)."""
    from transformers import AttentionInterface

    model = _fp32_model(str(model_dir))
    params = getattr(model.config, "rope_parameters", None) or {}
    assert params.get("rope_type", "default") == "default", "the oracle states plain RoPE only"
    theta = float(params.get("rope_theta") or model.config.rope_theta)
    gate = load_gate(rule.gate) if rule.selector == "gate" else None
    b, start = rule.block_size, rule.sparse_from
    selected: Dict[int, Dict[int, List[List[int]]]] = {}
    anchors: Dict[int, List[List[int]]] = {}
    all_scores: Dict[int, torch.Tensor] = {}

    def attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        """query `[1, H_q, T, D]`, key / value `[1, H_kv, T, D]` after RoPE. Dense causal rows, then the
        rows p >= sparse_from recomputed over their selection."""
        layer = module.layer_idx
        if rule.kv_fp8 is not None:  # what every reader of an fp8 cache sees
            s_l = (rule.kv_scales or {}).get(layer, 1.0)
            k_s, v_s = s_l if isinstance(s_l, tuple) else (s_l, s_l)
            read = (v_s, k_s) if rule.kv_scales_crossed else (k_s, v_s) if rule.kv_scales_read else (1.0, 1.0)
            key, value = ((x.float() / _per_head(s)).to(rule.kv_fp8).float() * _per_head(r)
                          for x, s, r in ((key, k_s, read[0]), (value, v_s, read[1])))
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling,
                                                               enable_gqa=True)  # [1, H_q, T, D]
        h_q, t, d = query.shape[1], query.shape[2], query.shape[3]
        h_kv = key.shape[1]
        g = h_q // h_kv
        q_post, k_post, v = query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1)
        q_pre, k_pre = (x.reshape(t, -1, d) for x in (module._oracle_q_pre, module._oracle_k_pre))
        if rule.kv_fp8 is not None:  # the cache's keys with the model's RoPE undone
            k_pre = rope(k_post.float().transpose(0, 1), -torch.arange(t), theta).transpose(0, 1)
        if rule.prompt_anchors:
            anchors[layer] = anchors_at(q_post[start - 1], k_post[:start], scaling, b, rule.prompt_anchors)
        positions = torch.arange(start, t)
        n_all = t // b  # complete blocks: query p's candidates are the first p // b of them
        runs, run = rule.sub_blocks, b // rule.sub_blocks  # each run scored as a block of `run` tokens, max per block
        if rule.selector == "gate":
            scores = gate_scores(gate[layer], q_pre[start:], positions, k_pre, n_all * runs, run, theta)
        elif rule.selector == "quest":
            scores = quest_scores(q_post[start:], k_post, n_all * runs, run)
        if rule.selector in ("gate", "quest"):
            scores = scores.unflatten(-1, (n_all, runs)).amax(-1)
            all_scores[layer] = scores.detach().clone()
        else:
            scores = torch.zeros(t - start, h_kv, n_all)
        selected[layer] = {}
        allowed = torch.zeros(h_kv, t - start, t, dtype=torch.bool)  # [H_kv, P, T]: keys attended
        for i, p in enumerate(positions.tolist()):
            n = p // b
            head_anchors = anchors.get(layer, [()] * h_kv)
            picks = [select(rule, n, scores[i, h, :n].tolist(), head_anchors[h], k=rule.exact_rerank * rule.top_k)
                     for h in range(h_kv)]
            if rule.exact_rerank > 1 and n > rule.top_k:  # the second level: the picks by their mass among themselves
                for h in range(h_kv):
                    blocks = [k_post[m * b:(m + 1) * b, h].float() for m in picks[h]]
                    if rule.rerank_keys == "int4":
                        blocks = [_four_bit(x) for x in blocks]
                    keys = torch.cat(blocks)
                    logits = q_post[p, h * g:(h + 1) * g].float() @ keys.T * scaling  # [G, tokens of the picks]
                    mass = torch.softmax(logits, -1).view(g, len(picks[h]), b).sum(-1).amax(0).tolist()
                    second = [float("-inf")] * n
                    for m, w in zip(picks[h], mass):
                        second[m] = w
                    picks[h] = select(rule, n, second, head_anchors[h])
            selected[layer][p] = picks
            picks = ((rule.follow or {}).get(layer) or {}).get(p, picks)
            for h in range(h_kv):
                for m in picks[h]:  # the selected blocks' keys, then the query's own block up to the query
                    allowed[h, i, m * b:(m + 1) * b] = True
                allowed[h, i, n * b:p + 1] = True
        q_rows = q_post[start:].float().view(t - start, h_kv, g, d).permute(1, 2, 0, 3)  # [H_kv, G, P, D]
        logits = torch.einsum("hgpd,thd->hgpt", q_rows, k_post.float()) * scaling
        logits = logits.masked_fill(~allowed[:, None], float("-inf"))
        rows = torch.einsum("hgpt,thd->hgpd", torch.softmax(logits, -1), v.float())  # [H_kv, G, P, D]
        out[0, :, start:] = rows.reshape(h_q, t - start, d).to(out.dtype)
        return out.transpose(1, 2), None

    hooks = []
    for layer in model.model.layers:
        attn = layer.self_attn
        for side in ("q", "k"):  # the query / key before RoPE: after the model's q/k norm where it has one
            src = getattr(attn, f"{side}_norm", None)
            src = getattr(attn, f"{side}_proj") if src is None else src
            hooks.append(src.register_forward_hook(
                lambda mod, inp, out, attn=attn, side=side: setattr(attn, f"_oracle_{side}_pre", out[0])))
    ids = torch.tensor([list(prompt) + list(tokens)])
    # Logits only where a check reads them: from the prompt's last position (the prefill's token) on.
    first = max(0, min(start, len(prompt)) - 1)
    keep = ids.shape[1] - first
    AttentionInterface.register(ORACLE_ATTN, attention)
    previous = model.config._attn_implementation
    try:
        with torch.no_grad():
            model.set_attn_implementation(ORACLE_ATTN)
            sparse = torch.log_softmax(model(ids, logits_to_keep=keep).logits[0].float(), -1)
            model.set_attn_implementation(previous)
            dense = torch.log_softmax(model(ids, logits_to_keep=keep).logits[0].float(), -1)
    finally:
        model.set_attn_implementation(previous)
        for hook in hooks:
            hook.remove()
        for layer in model.model.layers:  # the cached model keeps no activations between runs
            for side in ("q", "k"):
                layer.self_attn.__dict__.pop(f"_oracle_{side}_pre", None)
    return OracleRun(TailRows(sparse, first), TailRows(dense, first), selected, anchors, all_scores)


def oracle_check(prompt, out: Decode, records, model_dir, rule: Rule, n: int,
                 oracle: Optional[OracleRun] = None) -> OracleRun:
    """The server's decode `out` (n tokens for `prompt`, which is rule.sparse_from tokens long) equals the
    oracle's under `rule`: at every step the logprob of its token within LOGPROB_TOL (step 0 is the dense
    prefill's, the others sparse decode steps) and (CPU) the token the oracle's argmax; (CPU) every logged decode
    step's layer-0 selection, and its anchors, the oracle's; and sparse differs from dense by far more than the
    tolerance. Returns the oracle's run (pass it back as `oracle` to reuse it)."""
    generated = out.token_ids
    assert len(prompt) == rule.sparse_from, (len(prompt), rule.sparse_from)
    assert len(generated) == len(out.logprobs) == n, (len(generated), len(out.logprobs), n)
    oracle = oracle or run_oracle(model_dir, rule, prompt, generated)
    on_gpu = torch.cuda.is_available()
    diffs, gaps_dense = [], []
    for i in range(n):  # step i's token was chosen at position len(prompt) - 1 + i
        pos = len(prompt) - 1 + i
        want = oracle.sparse_logprobs[pos, generated[i]].item()
        diffs.append(abs(out.logprobs[i] - want))
        assert diffs[-1] <= LOGPROB_TOL, (i, out.logprobs[i], want)
        if i:
            gaps_dense.append(abs(oracle.dense_logprobs[pos, generated[i]].item() - want))
        best = oracle.sparse_logprobs[pos].argmax().item()
        # Greedy decoding picks the oracle's argmax; on CPU (fp32) a swap would need a near tie, and compare.FP32
        # allows none, so a difference fails here, naming the gap.
        assert on_gpu or best == generated[i], (i, best, generated[i], oracle.sparse_logprobs[pos, best].item() - want)
    print(f"[oracle] {rule.selector} budget {rule.budget}: {n} steps, max |dlogprob| {max(diffs):.3g}, "
          f"sparse vs dense up to {max(gaps_dense):.3g}")
    # The comparison can tell sparse from dense: at some step they differ by more than the tolerance (on GPU,
    # 0.15, a server decoding densely would pass every step above), and there the server is the sparse one.
    widest = max(range(len(gaps_dense)), key=gaps_dense.__getitem__)
    assert gaps_dense[widest] > max(2e-2, LOGPROB_TOL), gaps_dense
    assert diffs[widest + 1] < gaps_dense[widest] / 2, (widest + 1, diffs[widest + 1], gaps_dense[widest])
    if not on_gpu:  # bf16 scores on GPU may order near-equal blocks differently
        steps = {rec["seq_lens"][0] - 1: rec for rec in records}  # query position -> the step's record (layer 0)
        # The n - 1 decode steps that chose tokens 1.., and maybe the one the overlap scheduler runs past the last.
        decode_steps = set(range(rule.sparse_from, rule.sparse_from + n - 1))
        assert decode_steps <= set(steps) <= decode_steps | {rule.sparse_from + n - 1}, sorted(steps)
        for pos, rec in steps.items():
            assert rec["selected"][0] == oracle.selected[0][pos], (pos, rec["selected"][0], oracle.selected[0][pos])
            if rule.prompt_anchors:
                assert rec["anchors"][0] == oracle.anchors[0], (pos, rec["anchors"][0], oracle.anchors[0])
    return oracle
