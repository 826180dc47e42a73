"""Perplexity of the last tokens of held-out windows under SAS sparse attention.

    python -m sas_backend.training.eval_ppl --model DIR --data PATH [PATH ...] [--window 4096]
        [--last 512] [--budgets 256 512 1024] [--gate NAME=DIR ...]
        [--baselines oracle quest sink-local random] [--block-size 64] [--max-windows N]
        [--json OUT.json] [--no-progress] [--reuse EARLIER.json --no-recall] [--summary-dtype {fp32,bf16}]
        [--gate-dtype {fp32,bf16}]

Each held-out row has window + 1 tokens: the model reads the first `window`; the queries at the
last `last` positions (window-last .. window-1) are sparse and each predicts the next token,
so the score is the perplexity of the last `last` tokens. A sparse query attends its own block
(causal) plus K previous complete blocks, K = budget // block: the serving rule (`--sas-budget B`
selects B // 64 blocks besides the current one), the same in training. Earlier positions attend
densely, as after a dense prefill. Selectors (all through `sas_backend.hf.sparse_eval`, the
server's selection component): dense; every `--gate` checkpoint; and the `--baselines`:
`oracle` (blocks ranked by their true attention mass, max over the kv group's heads), `quest`
(per-block key min/max bound), `sink-local` (block 0 plus the K-1 blocks right before the own
block), `random`. Held-out rows come from the same deterministic document split as training
(`data.split_documents`). `--reuse` takes what an earlier run on the same windows already measured (its
baselines, and gate variants with the same weights and forced blocks), so a new gate is measured alone and
still compared side by side in one results file. `--summary-dtype bf16` keeps the block summaries of the
selectors that have them (the gates, `quest`) in bf16 between summarizing and scoring, as a bf16 summary pool
stores them; the dtype is recorded, and `--reuse` takes those selectors only from a run with the same one.
`--gate-dtype bf16` reads the gates' weights (all their parameters) rounded to bf16, computing in fp32 as before,
as a kernel reading a bf16 copy of the weights does; recorded too, and `--reuse` takes gates only from a run with
the same one (the baselines have no gate weights).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
import time
from typing import Dict, List, Optional

import torch

from sas_backend.hf.candidates import gate_exact_factor  # noqa: E402
from sas_backend.hf.sparse_eval import GATE_DTYPES, SUMMARY_DTYPES, eval_selectors  # noqa: E402
from sas_backend.selection import selector_class, selector_names  # noqa: E402
from sas_backend.provenance import git_state

# The training-free selectors and evaluation references: every selector but dense and those reading gate weights.
BASELINES = tuple(s for s in eval_selectors()
                  if s != "dense" and not (s in selector_names() and selector_class(s).needs_gate))
# --candidates calibrated from text (hf.candidates): their numbers depend on --calib-tokens.
CALIBRATED = ("pairs", "pca")
# The baselines whose numbers depend on --summary-dtype (they score stored block summaries), besides the gates.
SUMMARY_BASELINES = ("quest",)
KV_FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}  # --kv-fp8
# --reuse: how far a window's dense NLL may differ from the earlier run's (CPU kernels differ across machines in
# the last bits; another window or model differs by percents)
REUSE_TOLERANCE = 1e-5


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sas_backend.training.eval_ppl",
                                description="Held-out perplexity under SAS sparse attention: "
                                            "dense vs gates vs baselines.")
    p.add_argument("--model", required=True, help="Hugging Face model directory")
    p.add_argument("--data", required=True, nargs="+", help="same sources as training (files, dirs, @essays, @stdlib)")
    p.add_argument("--window", type=int, default=4096, help="context tokens per window")
    p.add_argument("--last", type=int, default=512, help="sparse queries at the end of each window (scored)")
    p.add_argument("--budgets", type=int, nargs="+", default=[256, 512, 1024],
                   help="token budgets: K = budget // block previous blocks, besides the query's own")
    p.add_argument("--gate", action="append", default=[], metavar="NAME=DIR",
                   help="a gate checkpoint to evaluate, with the forced blocks its serving record names (as served)")
    p.add_argument("--gate-forced", nargs="+", default=None, metavar="SINK,LOCAL",
                   help="evaluate every gate with each of these forced-block settings instead (inside K), "
                        "named NAME+sSINKlLOCAL, e.g. --gate-forced 0,0 1,1 1,2")
    p.add_argument("--prompt-anchors", type=int, nargs="+", default=None, metavar="R",
                   help="also evaluate every gate variant with R prompt anchors (the server's --sas-prompt-anchors: "
                        "the R blocks per kv head the last unscored token attends most, forced for every scored "
                        "query), named +aR; a gate's record's own anchors apply to its plain variant")
    p.add_argument("--baselines", nargs="*", default=[], choices=BASELINES,
                   help="training-free selectors to evaluate beside the gates")
    p.add_argument("--candidates", nargs="*", default=[], metavar="NAME",
                   help="candidate selectors of sas_backend.hf.candidates to evaluate beside the baselines: exactmax, "
                        "exactmass, pairs<R>, pca<R>[mass], keys<R>[mass] (with --keys-index), gatec<X>exact (the one "
                        "--gate keeps X x K blocks, exactmass ranks them; the gate's sub-blocks: --sub-blocks), "
                        "gatec<X>exactq<bits> (over keys quantized to bits), gatec<X>group / gatec<X>tier (choices "
                        "inside fixed groups of X)")
    p.add_argument("--calib-tokens", type=int, default=4096,
                   help="@essays tokens that calibrate the pairs<R> and pca<R> candidates")
    p.add_argument("--keys-index", default=None, metavar="FILE",
                   help="the keys<R>[mass] candidates' learned projections (bench/learned_keys.py writes them)")
    p.add_argument("--window-baseline", action="store_true", help="same as --baselines sink-local")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--max-windows", type=int, default=None, help="evaluate at most this many windows")
    p.add_argument("--split", choices=("heldout", "train", "all"), default="heldout",
                   help="documents the windows come from; `all` for an out-of-domain set (@handbook, @site-packages)")
    p.add_argument("--heldout-fraction", type=float, default=None, help="must match training (default 0.2)")
    p.add_argument("--seed", type=int, default=0, help="document order of the packed windows")
    p.add_argument("--json", default=None, help="write the results here (default: print only)")
    p.add_argument("--plot", default=None, metavar="PREFIX",
                   help="write PREFIX-ppl.png (perplexity change vs budget) and PREFIX-recall.png (recall per layer)")
    p.add_argument("--recall-facts", type=int, default=0, metavar="N",
                   help="make every window a recall window: N facts spliced before the scored tail and restated "
                        "in it (sas_backend.training.recall; the needle test's mechanism, N trials per window)")
    p.add_argument("--no-recall", action="store_true", help="skip the per-layer attention-mass recall analysis")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--no-progress", action="store_true", help="no tqdm bar (a log line per window instead)")
    p.add_argument("--reuse", default=None, metavar="RESULTS.json",
                   help="take measurements from an earlier run's --json on the same windows instead of repeating "
                        "them: every --baselines selector it holds, and every gate variant whose weights (sha256), "
                        "forced blocks and anchors it measured; each window's dense NLL must match that file's "
                        f"(relative {REUSE_TOLERANCE:g}) or the run stops; needs --no-recall")
    p.add_argument("--summary-dtype", choices=tuple(SUMMARY_DTYPES), default="fp32",
                   help="what the block summaries of the gates and quest are stored in between summarizing and "
                        "scoring: fp32 (default) or bf16 (rounded to bf16 as a bf16 summary pool stores them, read "
                        "back as fp32 for the score); recorded in the results")
    p.add_argument("--gate-dtype", choices=tuple(GATE_DTYPES), default="fp32",
                   help="what the gates' weights (projections and RMSNorm weights) are read from: fp32 (default) or "
                        "bf16 (rounded to bf16 and read back as fp32, as a kernel computing in fp32 from a bf16 "
                        "copy of the weights sees them); recorded in the results")
    p.add_argument("--kv-fp8", choices=tuple(KV_FP8), default=None,
                   help="an fp8 KV cache (scale 1): every scored query reads K/V rounded to this dtype, the dense "
                        "reference too (issue 66: sas-fp8 against dense-fp8; dense-fp8 against dense from a run "
                        "without it on the same windows)")
    p.add_argument("--sub-blocks", type=int, default=1, metavar="N",
                   help="summaries per block for the gates and quest (the server's --sas-sub-blocks: each run of "
                        "block / N tokens summarized on its own, a block scored by its best run); recorded in the "
                        "results; --reuse takes only the other baselines then")
    p.add_argument("--resume", action="store_true",
                   help="with --json: continue from JSON's .partial.json, which a run writes after every measurement "
                        "and removes when done (a killed long run keeps what it measured); refused if it was "
                        "made for other data, windows, budgets, gates or selectors")
    return p


def partial_path(json_path: str) -> str:
    """Where a run with `--json json_path` keeps its measurements so far."""
    return os.path.splitext(json_path)[0] + ".partial.json"


class Progress:
    """What a run has measured so far, saved after every measurement (`save`), reloaded by `--resume`.

    dense: `[windows done]` summed NLL of each window; per_window: selector -> budget -> the same;
    recall: selector -> budget -> layer -> [captured, best] (None without the recall analysis).
    A (window, budget, selector) item is done when its list holds that window.
    """

    def __init__(self, path: Optional[str], key: dict, selectors, budgets, with_recall: bool):
        self.path, self.key = path, key
        self.dense: List[float] = []
        self.per_window = {s: {bud: [] for bud in budgets} for s in selectors}
        self.recall = {s: {bud: {} for bud in budgets} for s in selectors} if with_recall else None

    def load(self) -> int:
        """Take over the partial file if there is one; returns the measurements it held. SystemExit when it
        was made for another run (its key differs)."""
        if not self.path or not os.path.exists(self.path):
            return 0
        with open(self.path, encoding="utf-8") as f:
            old = json.load(f)
        if old.get("key") != self.key:
            diff = sorted(k for k in set(self.key) | set(old.get("key", {}))
                          if old.get("key", {}).get(k) != self.key.get(k))
            raise SystemExit(f"error: {self.path} was made for another run (differs in {', '.join(diff)}); "
                             "remove it or run without --resume")
        self.dense = old["dense"]
        for s, per in old["per_window"].items():
            for bud, v in per.items():
                self.per_window[s][int(bud)] = v
        if self.recall is not None:
            for s, per in old["recall"].items():
                for bud, layers in per.items():
                    self.recall[s][int(bud)] = {int(layer): cb for layer, cb in layers.items()}
        return len(self.dense) + sum(len(v) for per in self.per_window.values() for v in per.values())

    def done(self, window: int, name: Optional[str] = None, budget: Optional[int] = None) -> bool:
        """Whether window's dense NLL (name None) or its (name, budget) NLL is measured."""
        got = self.dense if name is None else self.per_window[name][budget]
        return len(got) > window

    def save(self) -> None:
        if not self.path:
            return
        rec = {"key": self.key, "dense": self.dense,
               "per_window": {s: {str(b): v for b, v in per.items()} for s, per in self.per_window.items()},
               "recall": None if self.recall is None else {
                   s: {str(b): {str(layer): cb for layer, cb in layers.items()} for b, layers in per.items()}
                   for s, per in self.recall.items()}}
        tmp = self.path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(rec, f)
        os.replace(tmp, self.path)  # never half a file, whenever the run is killed


def parse_gates(specs: List[str]) -> Dict[str, str]:
    """`["NAME=DIR", ...]` -> `{NAME: DIR}` (ordered); clear errors on malformed or repeated names."""
    out: Dict[str, str] = {}
    for s in specs:
        name, sep, path = s.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"error: --gate expects NAME=DIR, got {s!r}")
        if name in out or name in ("dense",) + BASELINES:
            raise SystemExit(f"error: --gate name {name!r} is repeated or reserved")
        out[name] = path
    return out


def parse_forced(specs: Optional[List[str]]) -> Optional[List[tuple]]:
    """`["1,2", ...]` -> `[(1, 2), ...]` (sink, local blocks); None stays None (the gates' records)."""
    if specs is None:
        return None
    out = []
    for s in specs:
        try:
            sink, local = (int(x) for x in s.split(","))
        except ValueError:
            raise SystemExit(f"error: --gate-forced expects SINK,LOCAL (two integers), got {s!r}") from None
        if sink < 0 or local < 0:
            raise SystemExit(f"error: --gate-forced {s!r}: block counts must be >= 0")
        out.append((sink, local))
    return out


def gate_variants(gate_paths: Dict[str, str], records: Dict[str, dict], forced: Optional[List[tuple]],
                  anchors: Optional[List[int]] = None):
    """`{selector name: (gate name, sink, local, prompt anchors)}`: each gate as its serving record forces blocks
    (and anchors), or under each `forced` (sink, local) setting, named `NAME+sSlL` (no anchors); then each of
    those again with every `anchors` count R, named `...+aR`."""
    if forced is None:
        base = {n: (n, records[n].get("sink_blocks", 0), records[n].get("local_blocks", 0),
                    records[n].get("prompt_anchors", 0)) for n in gate_paths}
    else:
        base = {f"{n}+s{s}l{local}": (n, s, local, 0) for n in gate_paths for s, local in forced}
    out = dict(base)
    for name, (g, s, local, _) in base.items():
        for r in anchors or []:
            out[f"{name}+a{r}"] = (g, s, local, r)
    return out


def check_candidates(names: List[str]) -> List[str]:
    """`names` (--candidates), or SystemExit naming the first that is not a candidate eval_ppl runs."""
    from sas_backend.hf.candidates import is_candidate, sub_block_alias

    for name in names:
        if not is_candidate(name) or sub_block_alias(name, 64) is not None:
            raise SystemExit(f"error: --candidates {name}: not a candidate eval_ppl runs (sas_backend.hf.candidates) "
                             "(exactmax, exactmass, pairs<R>, pca<R>[mass], keys<R>[mass], gatec<X>exact[q<bits>], "
                             "gatec<X>group, gatec<X>tier; the gate's sub-blocks: --sub-blocks)")
    return list(names)


def calibrate_candidates(model, tokenizer, names: List[str], calib_tokens: int) -> Dict[str, dict]:
    """`{candidate: SparseEvalSpec.index}` of the calibrated candidates among `names` (`pairs<R>`: RoPE pairs,
    `pca<R>[mass]`: the fitted projections), from one dense forward of the first `calib_tokens` tokens of @essays
    (the gates' training text; keep it out of every evaluation)."""
    import re

    from sas_backend.hf.candidates import calibrate_model_pairs, calibrate_model_pca, top_pairs
    from sas_backend.training.data import read_documents

    wanted = {name: re.match(r"^(pairs|pca)(\d+)", name) for name in names}
    wanted = {name: (m.group(1), int(m.group(2))) for name, m in wanted.items() if m}
    if not wanted:
        return {}
    essays = "\n\n".join(d.text for d in sorted(read_documents(["@essays"]), key=lambda d: d.name))
    ids = torch.tensor(tokenizer(essays, add_special_tokens=False)["input_ids"][:calib_tokens])
    out = {}
    if any(kind == "pairs" for kind, _ in wanted.values()):
        spread = calibrate_model_pairs(model, ids)
        out.update({n: top_pairs(spread, r) for n, (kind, r) in wanted.items() if kind == "pairs"})
    ranks = sorted({r for kind, r in wanted.values() if kind == "pca"})
    if ranks:
        fits = calibrate_model_pca(model, ids, ranks)
        out.update({n: fits[r] for n, (kind, r) in wanted.items() if kind == "pca"})
    return out


def load_keys_index(path: Optional[str], names: List[str], index: Dict[str, dict]) -> Optional[str]:
    """Put the learned projections of `path` (`{"index": {rank: {layer: (Pq, Pk)}}}`, bench/learned_keys.py) under
    every `keys<R>[mass]` of `names` into `index`; returns the file's sha256 (None without such candidates).
    SystemExit when a keys candidate has no file or the file no projections of its rank."""
    import hashlib

    keys = [n for n in names if n.startswith("keys")]
    if not keys:
        if path:
            raise SystemExit("error: --keys-index without a keys<R> candidate in --candidates")
        return None
    if not path:
        raise SystemExit(f"error: --candidates {keys[0]} needs --keys-index (bench/learned_keys.py)")
    with open(path, "rb") as f:
        sha = hashlib.sha256(f.read()).hexdigest()
    fitted = torch.load(path, map_location="cpu")["index"]
    for name in keys:
        rank = int(name[4:].removesuffix("mass"))
        if rank not in fitted:
            raise SystemExit(f"error: --keys-index {path} holds ranks {sorted(fitted)}, not {rank} ({name})")
        index[name] = fitted[rank]
    return sha


def reuse_plan(ref: dict, ref_path: str, *, data_record: dict, split: str, windows: int, window: int, last: int,
               block_size: int, budgets: List[int], variants: dict, gate_sha256: Dict[str, str],
               baselines: List[str], summary_dtype: str = "fp32",
               gate_dtype: str = "fp32", sub_blocks: int = 1,
               calib_tokens: Optional[int] = None, keys_sha256: Optional[str] = None) -> Dict[str, Dict[int, str]]:
    """What `--reuse` takes from `ref` (an earlier run's JSON): `{selector: {budget: ref selector}}` for every
    baseline `ref` measured under the same name, and every gate variant `(gate, sink, local, anchors)` of
    `variants` whose gate weights (sha256) and forced settings `ref` measured, at each budget it has; the gates and
    the `SUMMARY_BASELINES` only when `ref`'s block summaries were stored in `summary_dtype` too, and the gates
    only when `ref` read their weights in `gate_dtype` too (a file without either field: fp32), and both only when
    `ref` summarized blocks in `sub_blocks` runs too (a file without the field: 1); calibrated candidates
    (`pairs<R>`, `pca<R>`) only when `ref` calibrated them on `calib_tokens` tokens too, and learned keys
    (`keys<R>`) only from the same projections file (`keys_sha256`).
    SystemExit when `ref` was made on other windows (data, split, window, scored tail, block size, fewer
    windows); the dense NLLs per window are compared as the run goes (`check_reused_dense`)."""
    ours = {"data": data_record, "split": split, "window": window, "last": last, "block_size": block_size}
    differ = [k for k, v in ours.items() if ref.get(k) != v]
    if ref.get("windows", 0) < windows:
        differ.append(f"windows ({ref.get('windows')} < {windows})")
    if differ:
        raise SystemExit(f"error: --reuse {ref_path} was measured on other windows (differs in {', '.join(differ)})")
    measured = ref.get("nll_per_window", {})
    by_weights = {}  # (sha256, sink, local, anchors) -> the ref's variant name
    for name, v in ref.get("gate_variants", {}).items():
        sha = ref.get("gate_sha256", {}).get(v["gate"])
        by_weights[(sha, v["sink_blocks"], v["local_blocks"], v.get("prompt_anchors", 0))] = name
    same_summaries = (ref.get("summary_dtype", "fp32") == summary_dtype
                      and ref.get("sub_blocks", 1) == sub_blocks)
    same_gate_weights = ref.get("gate_dtype", "fp32") == gate_dtype
    sources = {name: by_weights[(gate_sha256[g], s_, l_, a_)] for name, (g, s_, l_, a_) in variants.items()
               if (gate_sha256[g], s_, l_, a_) in by_weights and same_summaries and same_gate_weights}
    same_calib = ref.get("calib_tokens") == calib_tokens
    same_keys = keys_sha256 is not None and ref.get("keys_index_sha256") == keys_sha256
    sources.update({name: name for name in baselines if (same_summaries or name not in SUMMARY_BASELINES)
                    and (same_calib or not name.startswith(CALIBRATED)) and (same_keys or not name.startswith("keys"))
                    and gate_exact_factor(name) is None})  # a two-level candidate's first level is a gate: anew
    plan = {}
    for name, src in sources.items():
        got = {bud: src for bud in budgets if str(bud) in measured.get(src, {})}
        if got:
            plan[name] = got
    return plan


def check_reused_dense(ref: dict, ref_path: str, w: int, dense_nll: float) -> float:
    """Window `w`'s dense NLL against `ref`'s: the relative difference, SystemExit beyond REUSE_TOLERANCE."""
    want = ref["dense_nll_per_window"][w]
    rel = abs(dense_nll - want) / abs(want)
    if rel > REUSE_TOLERANCE:
        raise SystemExit(f"error: --reuse {ref_path}: window {w}'s dense NLL is {dense_nll:.6f} here and {want:.6f} "
                         f"there (relative {rel:.1e} > {REUSE_TOLERANCE:g}): another model or other windows; "
                         "run without --reuse")
    return rel


def load_gates(path: str, model, block_size: int, device):
    """`({layer: AttnGate}, serve defaults)` from a checkpoint, refused unless it fits `model` and
    `block_size`; the serve defaults are `GateConfig.serve_defaults()` (budget, forced blocks)."""
    from sas_backend.gate.checkpoint import load_gate_checkpoint, validate_for_geometry
    from sas_backend.gate.module import gates_from_tensors
    from sas_backend.geometry import ModelGeometry

    config, tensors = load_gate_checkpoint(path)
    geo = ModelGeometry.from_hf_config(model.config)
    validate_for_geometry(config, tensors, geo, block_size=block_size)
    gates = gates_from_tensors(tensors, range(geo.num_layers), gate_dim=config.gate_dim, device=device)
    return gates, config.serve_defaults()


@torch.no_grad()
def prefix_cache(model, ids: torch.Tensor, last: int):
    """The dense KV cache of the first `window - last` tokens of `ids` `[window + 1]` (shared by
    every selector: the earlier positions are dense, as after a dense prefill)."""
    inp = ids[:-1][None]
    return model(input_ids=inp[:, :-last], use_cache=True, logits_to_keep=1).past_key_values


@torch.no_grad()
def window_nll(model, ids: torch.Tensor, last: int, spec=None, cache=None, recall=None) -> float:
    """Summed NLL of the last `last` tokens of `ids` `[window + 1]` given the first `window`;
    `spec` (a SparseEvalSpec) makes the attention sparse, None keeps the model dense.
    cache: `prefix_cache(model, ids, last)` to run only the last `last` queries on top of it (left
    as it was on return); None runs the whole window. recall: optional dict the selection's
    attention-mass recall accumulates into (see `sparse_eval`)."""
    from sas_backend.hf.sparse_eval import sparse_eval

    inp = ids[:-1][None]
    tgt = ids[-last:]
    if cache is None:
        kw = dict(input_ids=inp, use_cache=False, logits_to_keep=last)
    else:
        kw = dict(input_ids=inp[:, -last:], past_key_values=cache, use_cache=True)
    try:
        if spec is None:
            logits = model(**kw).logits
        else:
            with sparse_eval(model, spec, max_pos=inp.shape[1], recall=recall):
                logits = model(**kw).logits
    finally:
        if cache is not None:
            cache.crop(inp.shape[1] - last)  # drop the queries' own K/V: the prefix again
    return float(torch.nn.functional.cross_entropy(logits[0].float(), tgt, reduction="sum"))


def markdown_table(results: Dict[str, Dict[int, float]], dense: float, budgets: List[int], block: int) -> str:
    """Perplexity per selector and budget, then the change vs dense in percent."""
    head = "| selector | " + " | ".join(f"budget {b} (K={b // block})" for b in budgets) + " |"
    rule = "|" + "---|" * (len(budgets) + 1)
    lines = [head, rule, "| dense | " + " | ".join(f"{dense:.3f}" for _ in budgets) + " |"]
    for name, per in results.items():
        lines.append(f"| {name} | " + " | ".join(f"{per[b]:.3f}" for b in budgets) + " |")
    lines += ["", head.replace("| selector |", "| perplexity change vs dense |"), rule]
    for name, per in results.items():
        lines.append(f"| {name} | " + " | ".join(f"{100 * (per[b] / dense - 1):+.1f}%" for b in budgets) + " |")
    return "\n".join(lines)


def recall_table(recall: Dict[str, Dict[int, Dict[int, list]]], budgets: List[int]) -> str:
    """Attention-mass recall (selected / oracle's best K), all layers pooled, per selector and budget."""
    lines = ["| recall (all layers) | " + " | ".join(f"budget {b}" for b in budgets) + " |",
             "|" + "---|" * (len(budgets) + 1)]
    for name, per in recall.items():
        cells = []
        for b in budgets:
            cap = sum(v[0] for v in per[b].values())
            best = sum(v[1] for v in per[b].values())
            cells.append(f"{cap / best:.3f}" if best > 0 else "-")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def self_checks(window_nll_of: Dict[str, Dict[int, List[float]]], dense_nll: List[float], budgets: List[int],
                window: int, block: int) -> List[str]:
    """Invariants of the harness. Every selector equals dense where the budget covers the window
    (K * b >= window: every query attends everything): a violation raises. The oracle (most
    attention mass) should beat the others in each window; mass is not loss, so a window where it
    does not is reported, not fatal. Returns the report lines."""
    notes = []
    for b in budgets:
        if (b // block) * block < window:
            continue
        for name, per in window_nll_of.items():
            for w, (got, want) in enumerate(zip(per[b], dense_nll)):
                if abs(got - want) > 1e-4 * abs(want) + 1e-3:
                    raise SystemExit(f"error: self-check failed: {name} at budget {b} covers the {window}-token "
                                     f"window but its NLL {got:.4f} differs from dense {want:.4f} (window {w})")
        notes.append(f"check: budget {b} covers the window: every selector equals dense")
    if "oracle" in window_nll_of:
        for b in budgets:
            for name, per in window_nll_of.items():
                if name == "oracle":
                    continue
                worse = [w for w, (o, x) in enumerate(zip(window_nll_of["oracle"][b], per[b])) if o > x + 1e-6 * abs(x)]
                if worse:
                    notes.append(f"note: budget {b}: {name} had a lower NLL than the oracle in windows {worse}")
    return notes


def plot(results, dense: float, recall, budgets: List[int], prefix: str, title: str) -> List[str]:
    """PREFIX-ppl.png: perplexity change vs dense against the budget, a line per selector;
    PREFIX-recall.png: attention-mass recall per layer, a panel per budget. Returns the paths."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("error: --plot needs matplotlib: pip install matplotlib (or the sas-backend[bench] "
                         "extra; in a clone of the repository, SAS_EXTRAS=bench bash serve/install.sh)") from None
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, per in results.items():
        ax.plot(budgets, [100 * (per[b] / dense - 1) for b in budgets], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xticks(budgets, [str(b) for b in budgets])
    ax.set_xlabel("budget (tokens)")
    ax.set_ylabel("perplexity change vs dense (%)")
    ax.set_title(title, fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths = [f"{prefix}-ppl.png"]
    fig.savefig(paths[0], dpi=120)
    if recall:
        fig, axes = plt.subplots(1, len(budgets), figsize=(4 * len(budgets), 3.5), squeeze=False)
        for ax, b in zip(axes[0], budgets):
            for name, per in recall.items():
                layers = sorted(per[b])
                ax.plot(layers, [per[b][i][0] / per[b][i][1] if per[b][i][1] else 1.0 for i in layers], label=name)
            ax.set_title(f"budget {b}", fontsize=8)
            ax.set_xlabel("layer")
            ax.set_ylabel("attention-mass recall")
            ax.set_ylim(0, 1.02)
            ax.grid(alpha=0.3)
        axes[0][0].legend(fontsize=7)
        fig.suptitle(title, fontsize=8)
        fig.tight_layout()
        paths.append(f"{prefix}-recall.png")
        fig.savefig(paths[1], dpi=120)
    return paths


def main(argv: Optional[list] = None) -> int:
    args = build_parser().parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sas_backend.hf.sparse_eval import SparseEvalSpec, prompt_anchors
    from sas_backend.training.data import DEFAULT_HELDOUT_FRACTION, load_packed
    from sas_backend.training.cli import check_window_budgets
    from sas_backend.training.loop import progress_bar

    b = args.block_size
    check_window_budgets(args)
    candidates = check_candidates(args.candidates)
    baselines = list(dict.fromkeys(args.baselines + (["sink-local"] if args.window_baseline else []) + candidates))
    gate_paths = parse_gates(args.gate)
    if any(gate_exact_factor(c) is not None for c in candidates) and len(gate_paths) != 1:
        raise SystemExit("error: a gatec<X>exact candidate takes its first level from exactly one --gate")
    forced = parse_forced(args.gate_forced)
    if forced is not None and not gate_paths:
        raise SystemExit("error: --gate-forced needs at least one --gate")
    frac = DEFAULT_HELDOUT_FRACTION if args.heldout_fraction is None else args.heldout_fraction
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    data = load_packed(args.data, tokenizer, args.window + 1, split=args.split, heldout_fraction=frac, seed=args.seed)
    rows = data.rows if args.max_windows is None else data.rows[: args.max_windows]
    recall_rows = None
    if args.recall_facts:
        from sas_backend.training.recall import RecallSpec, add_recall_rows

        # a seed apart from training's (its --seed picks rows and facts): other keys and values
        try:
            spec = RecallSpec(1.0, args.recall_facts, tail=args.last, seed=1_000 + args.seed)
            rows, made = add_recall_rows(rows, tokenizer, spec)
        except ValueError as e:
            raise SystemExit(f"error: --recall-facts {args.recall_facts}: {e}") from None
        recall_rows = {**spec.record(), **made}
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).to(device).eval()
    index = calibrate_candidates(model, tokenizer, candidates, args.calib_tokens)
    keys_sha = load_keys_index(args.keys_index, candidates, index)
    loaded = {name: load_gates(path, model, b, device) for name, path in gate_paths.items()}
    gates = {name: g for name, (g, _) in loaded.items()}
    # A path names different gates at different commits: the weights' sha256 says which one was measured.
    from sas_backend.gate.gate_file import weights_sha256

    gate_sha256 = {name: weights_sha256(path) for name, path in gate_paths.items()}
    if args.prompt_anchors and min(args.prompt_anchors) < 1:
        raise SystemExit("error: --prompt-anchors counts must be >= 1")
    variants = gate_variants(gate_paths, {name: rec for name, (_, rec) in loaded.items()}, forced, args.prompt_anchors)
    sparse_from = args.window - args.last
    too_many = [f"{v} at budget {bud}" for v, (_, s, local, a) in variants.items() for bud in args.budgets
                if s + local + a > bud // b]
    if too_many:
        raise SystemExit(f"error: forced blocks exceed K for {', '.join(too_many)}")

    selectors = list(variants) + baselines
    top_k = {bud: bud // b for bud in args.budgets}
    ref, reused, reuse_sha = None, {}, None
    kv_fp8 = KV_FP8[args.kv_fp8] if args.kv_fp8 else None
    if args.reuse and kv_fp8 is not None:
        raise SystemExit("error: --reuse takes another run's dense NLLs, which --kv-fp8 changes: run without --reuse")
    if args.reuse:
        if not args.no_recall:
            raise SystemExit("error: --reuse needs --no-recall (the recall analysis is not taken over)")
        import hashlib

        with open(args.reuse, "rb") as f:
            raw = f.read()
        ref, reuse_sha = json.loads(raw), hashlib.sha256(raw).hexdigest()
        reused = reuse_plan(ref, args.reuse, data_record={**data.record(), "recall": recall_rows}, split=args.split,
                            windows=int(rows.shape[0]), window=args.window, last=args.last, block_size=b,
                            budgets=args.budgets, variants=variants, gate_sha256=gate_sha256, baselines=baselines,
                            summary_dtype=args.summary_dtype, gate_dtype=args.gate_dtype,
                            sub_blocks=args.sub_blocks, calib_tokens=args.calib_tokens if index else None,
                            keys_sha256=keys_sha)
        print(f"[eval_ppl] --reuse {args.reuse}: " + (", ".join(
            f"{n} (as {sorted(set(m.values()))[0]}, budgets {sorted(m)})" for n, m in reused.items())
            or "nothing fits"),
            flush=True)
    dense_rel_diff = []  # per window, with --reuse
    print(f"[eval_ppl] {rows.shape[0]} {args.split} windows of {args.window} tokens (+1 target), last {args.last} "
          f"scored; block {b}; " + ", ".join(f"budget {bud} -> top_k {k}" for bud, k in top_k.items())
          + f"; block summaries {args.summary_dtype}"
          + (f", {args.sub_blocks} a block (gates and quest)" if args.sub_blocks > 1 else "")
          + (f"; gate weights {args.gate_dtype}" if gate_paths else "")
          + (f"; K/V read through fp8 {args.kv_fp8} (the dense reference too)" if args.kv_fp8 else ""), flush=True)
    summary_dtype, gate_dtype = SUMMARY_DTYPES[args.summary_dtype], GATE_DTYPES[args.gate_dtype]

    # What the measurements depend on: a partial file made for anything else is refused.
    key = {"model": args.model, "data": data.record(), "recall_rows": recall_rows, "split": args.split,
           "windows": int(rows.shape[0]), "window": args.window, "last": args.last, "block_size": b,
           "budgets": args.budgets, "gate_sha256": gate_sha256,
           "variants": {v: list(x) for v, x in variants.items()}, "selectors": selectors, "recall": not args.no_recall,
           **({"reuse": reuse_sha} if reuse_sha else {}),
           **({"summary_dtype": args.summary_dtype} if args.summary_dtype != "fp32" else {}),
           **({"gate_dtype": args.gate_dtype} if args.gate_dtype != "fp32" else {}),
           **({"sub_blocks": args.sub_blocks} if args.sub_blocks != 1 else {}),
           **({"calib_tokens": args.calib_tokens} if index else {}),
           **({"keys_index_sha256": keys_sha} if keys_sha else {}),
           **({"kv_fp8": args.kv_fp8} if kv_fp8 is not None else {})}
    progress = Progress(partial_path(args.json) if args.json else None, key, selectors, args.budgets,
                        not args.no_recall)
    if args.resume:
        if not args.json:
            raise SystemExit("error: --resume needs --json (the partial file sits beside it)")
        resumed = taken = progress.load()
        print(f"[eval_ppl] resuming: {taken} measurements from {progress.path}" if taken else
              f"[eval_ppl] --resume: no {progress.path}, starting afresh", flush=True)
    else:
        resumed = 0
    dense_per_window, per_window, recall = progress.dense, progress.per_window, progress.recall
    t0 = time.time()
    git_at_start = git_state()  # the code that ran, not what the tree holds when it ends
    bar = progress_bar(int(rows.shape[0]), "eval_ppl", enabled=not args.no_progress)
    for w in range(rows.shape[0]):
        if progress.done(w) and all(progress.done(w, n, bud) for n in selectors for bud in args.budgets):
            if bar is not None:
                bar.update(1)
            continue
        ids = rows[w].to(device)
        cache = prefix_cache(model, ids, args.last)
        anchors = None  # the last unscored token's blocks, per layer (when a variant forces them)
        if not progress.done(w):  # with --kv-fp8 the reference is dense attention over the fp8 cache
            dense_spec = SparseEvalSpec(top_k=1, block_size=b, selector="dense", kv_fp8=kv_fp8) if kv_fp8 else None
            dense_per_window.append(window_nll(model, ids, args.last, dense_spec, cache=cache))
            progress.save()
        if ref is not None:
            dense_rel_diff.append(check_reused_dense(ref, args.reuse, w, dense_per_window[w]))
        for bud in args.budgets:
            k = top_k[bud]
            for name in selectors:
                if progress.done(w, name, bud):
                    continue
                if bud in reused.get(name, {}):
                    per_window[name][bud].append(ref["nll_per_window"][reused[name][bud]][str(bud)][w])
                    progress.save()
                    continue
                if name in variants:
                    gate, sink, local, n_anchors = variants[name]
                    if n_anchors and anchors is None:
                        most = max(v[3] for v in variants.values())
                        anchors = prompt_anchors(model, ids[:sparse_from], cache, most, window=1, block_size=b)
                    spec = SparseEvalSpec(top_k=k, block_size=b, selector="gate", gates=gates[gate],
                                          sink_blocks=sink, local_blocks=local, sparse_from=sparse_from,
                                          anchors={lid: a[:, :n_anchors] for lid, a in anchors.items()}
                                          if n_anchors else None, summary_dtype=summary_dtype,
                                          gate_dtype=gate_dtype, sub_blocks=args.sub_blocks, kv_fp8=kv_fp8)
                elif gate_exact_factor(name) is not None:  # two levels: the one --gate first (--sub-blocks, its first
                    _, sink, local, _ = next(iter(variants.values()))  # variant's forced blocks), exact second
                    spec = SparseEvalSpec(top_k=k, block_size=b, selector=name, gates=next(iter(gates.values())),
                                          sink_blocks=sink, local_blocks=local,
                                          sparse_from=sparse_from, summary_dtype=summary_dtype,
                                          gate_dtype=gate_dtype, sub_blocks=args.sub_blocks, kv_fp8=kv_fp8)
                else:
                    spec = SparseEvalSpec(top_k=k, block_size=b, selector=name, sparse_from=sparse_from,
                                          summary_dtype=summary_dtype,
                                          sub_blocks=args.sub_blocks if name in SUMMARY_BASELINES else 1,
                                          kv_fp8=kv_fp8, index=index.get(name))
                rec = None if recall is None else recall[name][bud]
                per_window[name][bud].append(window_nll(model, ids, args.last, spec, cache, recall=rec))
                progress.save()
        if bar is not None:  # loss: the dense model's mean NLL per scored token so far
            bar.set_postfix(dense_loss=f"{sum(dense_per_window) / ((w + 1) * args.last):.4f}", refresh=False)
            bar.update(1)
        else:
            print(f"[eval_ppl] window {w + 1}/{rows.shape[0]} done ({time.time() - t0:.0f} s)", flush=True)
    if bar is not None:
        bar.close()

    n_tok = rows.shape[0] * args.last
    dense = math.exp(sum(dense_per_window) / n_tok)
    results = {s: {bud: math.exp(sum(v) / n_tok) for bud, v in per.items()} for s, per in per_window.items()}
    checks = self_checks(per_window, dense_per_window, args.budgets, args.window, b)
    table = markdown_table(results, dense, args.budgets, b)
    if recall is not None:
        table += "\n\n" + recall_table(recall, args.budgets)
    print(table)
    for line in checks:
        print(f"[eval_ppl] {line}")
    plots = []
    if args.plot:
        title = (f"{os.path.basename(os.path.normpath(args.model))}, {' '.join(args.data)}, "
                 f"{rows.shape[0]} windows of {args.window}, last {args.last}")
        plots = plot(results, dense, recall, args.budgets, args.plot, title)
        print(f"[eval_ppl] wrote {', '.join(plots)}")
    if args.json:
        out = {
            "model": args.model,
            "data": {**data.record(), "recall": recall_rows},
            "split": args.split,
            "windows": int(rows.shape[0]),
            "window": args.window,
            "last": args.last,
            "scored_tokens": n_tok,
            "block_size": b,
            "budgets": [{"budget": bud, "top_k": top_k[bud]} for bud in args.budgets],
            "summary_dtype": args.summary_dtype,
            "gate_dtype": args.gate_dtype,
            "sub_blocks": args.sub_blocks,
            "kv_fp8": args.kv_fp8,
            **({"calib_tokens": args.calib_tokens} if index else {}),
            **({"keys_index": args.keys_index, "keys_index_sha256": keys_sha} if keys_sha else {}),
            "gates": gate_paths,
            "gate_sha256": gate_sha256,
            "gate_variants": {v: {"gate": g, "sink_blocks": s_, "local_blocks": l_,
                                  **({"prompt_anchors": a_} if a_ else {})}
                              for v, (g, s_, l_, a_) in variants.items()},
            "dense": dense,
            "results": {s: {str(bud): v for bud, v in per.items()} for s, per in results.items()},
            "dense_nll_per_window": dense_per_window,
            "nll_per_window": {s: {str(bud): v for bud, v in per.items()} for s, per in per_window.items()},
            "recall_per_layer": None if recall is None else {
                s: {str(bud): {str(layer): cb for layer, cb in sorted(per[bud].items())} for bud in per}
                for s, per in recall.items()},
            "checks": checks,
            "reused": None if ref is None else {
                "file": args.reuse, "sha256": reuse_sha,
                "dense_max_relative_difference": max(dense_rel_diff, default=0.0),
                "measurements": {n: {str(bud): src for bud, src in m.items()} for n, m in reused.items()}},
            "plots": [os.path.relpath(p_) for p_ in plots],
            "table_markdown": table,
            "seconds": round(time.time() - t0, 1),  # this run's: a resumed one's earlier runs are not in it
            "resumed_measurements": resumed,
            "git": git_at_start,
            "command": "python -m sas_backend.training.eval_ppl " + shlex.join(sys.argv[1:] if argv is None else argv),
        }
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=2)
            f.write("\n")
        md = os.path.splitext(args.json)[0] + ".md"
        with open(md, "w", encoding="utf-8") as f:
            f.write(markdown_report(out))
        if progress.path and os.path.exists(progress.path):
            os.remove(progress.path)
        print(f"[eval_ppl] wrote {args.json} and {md}")
    return 0


def markdown_report(out: dict) -> str:
    """The results file as Markdown: what was measured (model, data, windows, commit, command),
    the tables, the self-check lines and the plots."""
    data = out["data"]
    lines = [
        f"# Perplexity under SAS sparse attention: {', '.join(data.get('sources', []))}",
        "",
        f"- model `{out['model']}`, {out['split']} split (held out by document), {out['windows']} windows of "
        f"{out['window']} tokens, last {out['last']} scored ({out['scored_tokens']} tokens), block {out['block_size']}",
        *([f"- recall windows: {data['recall']['facts']} facts spliced before the scored tail of each window and "
           "restated in it (`sas_backend.training.recall`)"] if data.get("recall") else []),
        f"- budget B -> K = B // {out['block_size']} previous blocks + the query's own (the serving rule)",
        "- block summaries (gates, quest): " + ("bf16 (rounded to bf16 as a bf16 summary pool stores them, scored "
                                               "in fp32)" if out.get("summary_dtype") == "bf16" else "fp32"),
        "- gate weights: " + ("bf16 (rounded to bf16 as a bf16 copy of the weights holds them, computed in fp32)"
                              if out.get("gate_dtype") == "bf16" else "fp32"),
        "- gates: " + (", ".join(f"{v} = `{g['gate']}` (sink {g['sink_blocks']}, local {g['local_blocks']}"
                                 + (f", prompt anchors {g['prompt_anchors']}" if g.get("prompt_anchors") else "") + ")"
                                 for v, g in out.get("gate_variants", {}).items()) or "none"),
        f"- commit `{out['git']['commit'][:12]}`{' (with local changes)' if out['git']['dirty'] else ''}, "
        f"{out['seconds']:.0f} s",
        f"- command: `{out['command']}`",
        *([f"- taken from `{out['reused']['file']}` (same windows: dense NLL per window within "
           f"{out['reused']['dense_max_relative_difference']:.1e}), not measured again: "
           + ", ".join(f"{n}" + (f" (there {sorted(set(m.values()))[0]})" if set(m.values()) != {n} else "")
                       for n, m in out["reused"]["measurements"].items())] if out.get("reused") else []),
        "",
        out["table_markdown"],
        "",
    ]
    lines += [f"- {c}" for c in out["checks"]]
    lines += [f"\n![{os.path.basename(p_)}]({os.path.basename(p_)})" for p_ in out["plots"]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
