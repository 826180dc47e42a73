"""The SAS paper's selection analysis on real windows: per-layer attention-mass coverage (raw and value-aware) and
the cross-layer overlap recall of the oracle's blocks, per selector and budget.

    python -m sas_backend.training.analysis --model DIR --data PATH [PATH ...] [--window 4096] [--last 512]
        [--budgets 256 512 1024 2048] [--gate NAME=DIR ...] [--gate-forced SINK,LOCAL ...]
        [--baselines oracle quest sink-local random] [--activations {sparse,dense}] [--block-size 64]
        [--split {heldout,train,all}] [--max-windows N] [--json OUT.json] [--no-progress]

The windows, the selectors and the budget rule are eval_ppl's (its data, gate and window helpers are imported:
the same `--data`/`--split`/`--seed` give the same windows, a gate runs with the forced blocks and prompt anchors
of its serving record unless `--gate-forced`); each (window, budget, selector) is one forward of the last `last`
queries over the dense prefix's cache, measured by `sas_backend.hf.analysis` (the definitions are in its module
doc). The JSON holds every per-layer number; the markdown beside it the tables: per selector and budget the mean
coverage (raw / value-aware) over layers, the three weakest layers, and the overlap recall (per layer, union over
layers per kv head, and over all kv heads), with the perplexity change of the same forwards ("sparse"
activations; with "dense" the forwards are the dense model's and no perplexity is reported).
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

from sas_backend.hf.analysis import ACTIVATIONS, BlockAnalysis, block_analysis, finite, weakest_layers
from sas_backend.provenance import git_state
from sas_backend.training.eval_ppl import (
    BASELINES,
    gate_variants,
    load_gates,
    parse_forced,
    parse_gates,
    prefix_cache,
    window_nll,
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sas_backend.training.analysis",
                                description="Per-layer attention-mass coverage and cross-layer overlap recall of "
                                            "the selected blocks: gates vs training-free selectors.")
    p.add_argument("--model", required=True, help="Hugging Face model directory")
    p.add_argument("--data", required=True, nargs="+", help="as eval_ppl (files, dirs, @handbook, @site-packages)")
    p.add_argument("--window", type=int, default=4096, help="context tokens per window")
    p.add_argument("--last", type=int, default=512, help="measured (sparse) queries at the end of each window")
    p.add_argument("--budgets", type=int, nargs="+", default=[256, 512, 1024, 2048],
                   help="token budgets: K = budget // block previous blocks, besides the query's own")
    p.add_argument("--gate", action="append", default=[], metavar="NAME=DIR",
                   help="a gate checkpoint, with the forced blocks and prompt anchors its serving record names")
    p.add_argument("--gate-forced", nargs="+", default=None, metavar="SINK,LOCAL",
                   help="measure every gate with each of these forced-block settings instead, named NAME+sSlL")
    p.add_argument("--baselines", nargs="*", default=[], choices=BASELINES, help="training-free selectors")
    p.add_argument("--activations", choices=ACTIVATIONS, default="sparse",
                   help="sparse (default): the model runs sparse, each layer measured on the rows serving computes; "
                        "dense: every selector measured on the dense model's activations")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--max-windows", type=int, default=None)
    p.add_argument("--split", choices=("heldout", "train", "all"), default="heldout")
    p.add_argument("--heldout-fraction", type=float, default=None, help="must match training (default 0.2)")
    p.add_argument("--seed", type=int, default=0, help="document order of the packed windows")
    p.add_argument("--json", default=None, help="write the results here (and the tables beside it as .md)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--no-progress", action="store_true", help="a log line per measurement only (no tqdm bar)")
    return p


@torch.no_grad()
def analysed_nll(model, ids: torch.Tensor, last: int, spec, cache, acc: BlockAnalysis, activations: str) -> float:
    """One forward of the last `last` queries of `ids` `[window + 1]` on `cache` (`prefix_cache`, cropped back on
    return) under `spec`, measured into `acc`; returns the summed NLL of the last `last` tokens."""
    inp = ids[:-1][None]
    try:
        with block_analysis(model, spec, acc, activations, max_pos=inp.shape[1]):
            logits = model(input_ids=inp[:, -last:], past_key_values=cache, use_cache=True).logits
    finally:
        cache.crop(inp.shape[1] - last)
    return float(torch.nn.functional.cross_entropy(logits[0].float(), ids[-last:], reduction="sum"))


def _cell(x: Optional[float], fmt: str = "{:.3f}") -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else fmt.format(x)


def markdown_tables(results: Dict[str, Dict[int, dict]], budgets: List[int], block: int,
                    dense_ppl: Optional[float]) -> str:
    """The coverage table and the recall table (per selector and budget), then per budget the per-layer coverage."""
    lines = ["| selector | budget (K) | coverage raw | coverage value-aware | weakest layers, raw | "
             "weakest layers, value-aware | ppl vs dense |", "|---|---|---|---|---|---|---|"]
    for name, per in results.items():
        for bud in budgets:
            r = per[bud]
            weak = {k: ", ".join(f"L{layer} {v:.3f}" for layer, v in weakest_layers(r[k]))
                    for k in ("coverage_raw", "coverage_value")}
            ppl = r.get("ppl")
            change = f"{100 * (ppl / dense_ppl - 1):+.2f}%" if ppl is not None and dense_ppl else "-"
            lines.append(f"| {name} | {bud} ({bud // block}) | {_cell(r['coverage_raw_mean'])} | "
                         f"{_cell(r['coverage_value_mean'])} | {weak['coverage_raw']} | {weak['coverage_value']} | "
                         f"{change} |")
    lines += ["", "| selector | budget (K) | per-layer recall | union recall per kv head | union recall, mean over "
              "kv heads | union recall, all heads | union blocks per kv head: oracle / selected | union blocks, all "
              "heads: oracle / selected | candidates |", "|---|---|---|---|---|---|---|---|---|"]
    for name, per in results.items():
        for bud in budgets:
            r = per[bud]
            u = r["union_blocks"]
            kv = " / ".join(_cell(x) for x in r["union_recall_per_kv_head"])
            lines.append(f"| {name} | {bud} ({bud // block}) | {_cell(r['layer_recall_mean'])} | {kv} | "
                         f"{_cell(r['union_recall_kv_mean'])} | {_cell(r['union_recall_all_heads'])} | "
                         f"{u['oracle_per_kv_head']:.1f} / {u['selected_per_kv_head']:.1f} | "
                         f"{u['oracle_all_heads']:.1f} / {u['selected_all_heads']:.1f} | {u['candidates']:.1f} |")
    names = list(results)
    for bud in budgets:
        lines += ["", f"Per-layer coverage at budget {bud} (K = {bud // block}), raw / value-aware:", "",
                  "| layer | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
        layers = sorted({layer for n in names for layer in results[n][bud]["coverage_raw"]})
        for layer in layers:
            cells = [f"{_cell(results[n][bud]['coverage_raw'].get(layer))} / "
                     f"{_cell(results[n][bud]['coverage_value'].get(layer))}" for n in names]
            lines.append(f"| {layer} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Optional[list] = None) -> int:
    args = build_parser().parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sas_backend.gate.gate_file import weights_sha256
    from sas_backend.hf.sparse_eval import SparseEvalSpec, prompt_anchors
    from sas_backend.training.data import DEFAULT_HELDOUT_FRACTION, load_packed
    from sas_backend.training.cli import check_window_budgets
    from sas_backend.training.loop import progress_bar

    b = args.block_size
    check_window_budgets(args)
    gate_paths = parse_gates(args.gate)
    forced = parse_forced(args.gate_forced)
    if forced is not None and not gate_paths:
        raise SystemExit("error: --gate-forced needs at least one --gate")
    baselines = list(dict.fromkeys(args.baselines))
    if not gate_paths and not baselines:
        raise SystemExit("error: nothing to measure: give --gate and/or --baselines")
    frac = DEFAULT_HELDOUT_FRACTION if args.heldout_fraction is None else args.heldout_fraction
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    data = load_packed(args.data, tokenizer, args.window + 1, split=args.split, heldout_fraction=frac, seed=args.seed)
    rows = data.rows if args.max_windows is None else data.rows[: args.max_windows]
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).to(device).eval()
    loaded = {name: load_gates(path, model, b, device) for name, path in gate_paths.items()}
    gates = {name: g for name, (g, _) in loaded.items()}
    gate_sha256 = {name: weights_sha256(path) for name, path in gate_paths.items()}
    variants = gate_variants(gate_paths, {name: rec for name, (_, rec) in loaded.items()}, forced)
    too_many = [f"{v} at budget {bud}" for v, (_, s, local, a) in variants.items() for bud in args.budgets
                if s + local + a > bud // b]
    if too_many:
        raise SystemExit(f"error: forced blocks exceed K for {', '.join(too_many)}")
    selectors = list(variants) + baselines
    sparse_from = args.window - args.last
    n_win = int(rows.shape[0])
    print(f"[analysis] {n_win} {args.split} windows of {args.window} tokens, last {args.last} measured; block {b}; "
          f"budgets {args.budgets}; selectors {', '.join(selectors)}; {args.activations} activations", flush=True)

    accs = {n: {bud: BlockAnalysis(bud // b, b) for bud in args.budgets} for n in selectors}
    nll = {n: {bud: [] for bud in args.budgets} for n in selectors}
    dense_nll: List[float] = []
    seconds = {n: 0.0 for n in selectors}
    total = n_win * len(args.budgets) * len(selectors)
    done = 0
    t0 = time.time()
    git_at_start = git_state()
    bar = progress_bar(total, "analysis", enabled=not args.no_progress)
    for w in range(n_win):
        ids = rows[w].to(device)
        cache = prefix_cache(model, ids, args.last)
        dense_nll.append(window_nll(model, ids, args.last, cache=cache))
        anchors = None
        for bud in args.budgets:
            k = bud // b
            for name in selectors:
                t1 = time.time()
                if name in variants:
                    gate, sink, local, n_anchors = variants[name]
                    if n_anchors and anchors is None:  # the last unmeasured token's blocks, as eval_ppl forces them
                        most = max(v[3] for v in variants.values())
                        anchors = prompt_anchors(model, ids[:sparse_from], cache, most, window=1, block_size=b)
                    spec = SparseEvalSpec(top_k=k, block_size=b, selector="gate", gates=gates[gate], sink_blocks=sink,
                                          local_blocks=local, sparse_from=sparse_from,
                                          anchors={lid: a[:, :n_anchors] for lid, a in anchors.items()}
                                          if n_anchors else None)
                else:
                    spec = SparseEvalSpec(top_k=k, block_size=b, selector=name, sparse_from=sparse_from)
                acc = accs[name][bud]
                nll[name][bud].append(analysed_nll(model, ids, args.last, spec, cache, acc, args.activations))
                dt = time.time() - t1
                seconds[name] += dt
                done += 1
                if bar is not None:
                    bar.update(1)
                else:
                    r = acc.result()
                    eta = (time.time() - t0) / done * (total - done)
                    print(f"[analysis] {done}/{total} window {w + 1}/{n_win} budget {bud} {name}: coverage raw "
                          f"{r['coverage_raw_mean']:.3f} value {r['coverage_value_mean']:.3f}, union recall kv "
                          f"{r['union_recall_kv_mean']:.3f} all {r['union_recall_all_heads']:.3f} (so far; {dt:.0f} s,"
                          f" {time.time() - t0:.0f} s total, ~{eta:.0f} s left)", flush=True)
    if bar is not None:
        bar.close()

    n_tok = n_win * args.last
    sparse_acts = args.activations == "sparse"
    dense_ppl = math.exp(sum(dense_nll) / n_tok)
    results = {}
    for name in selectors:
        results[name] = {}
        for bud in args.budgets:
            r = accs[name][bud].result()
            r["ppl"] = math.exp(sum(nll[name][bud]) / n_tok) if sparse_acts else None
            results[name][bud] = r
    table = markdown_tables(results, args.budgets, b, dense_ppl if sparse_acts else None)
    print(table)
    if args.json:
        out = {
            "model": args.model,
            "data": data.record(),
            "split": args.split,
            "windows": n_win,
            "window": args.window,
            "last": args.last,
            "block_size": b,
            "budgets": [{"budget": bud, "top_k": bud // b} for bud in args.budgets],
            "activations": args.activations,
            "gates": gate_paths,
            "gate_sha256": gate_sha256,
            "gate_variants": {v: {"gate": g, "sink_blocks": s_, "local_blocks": l_, "prompt_anchors": a_}
                              for v, (g, s_, l_, a_) in variants.items()},
            "definitions": "sas_backend/hf/analysis.py module doc; primary overlap recall: union_recall_kv_mean",
            "dense_ppl": dense_ppl,
            "dense_nll_per_window": dense_nll,
            "nll_per_window": {n: {str(bud): v for bud, v in per.items()} for n, per in nll.items()},
            "results": {n: {str(bud): _jsonable(r) for bud, r in per.items()} for n, per in results.items()},
            "seconds_per_selector": {n: round(s, 1) for n, s in seconds.items()},
            "seconds": round(time.time() - t0, 1),
            "git": git_at_start,
            "command": "python -m sas_backend.training.analysis " + shlex.join(sys.argv[1:] if argv is None else argv),
            "table_markdown": table,
        }
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=2)
            f.write("\n")
        md = os.path.splitext(args.json)[0] + ".md"
        with open(md, "w", encoding="utf-8") as f:
            f.write(markdown_report(out))
        print(f"[analysis] wrote {args.json} and {md}")
    return 0


def _jsonable(r: dict) -> dict:
    """A `BlockAnalysis.result()` with string layer keys and None for NaN."""
    out = {}
    for k, v in r.items():
        if isinstance(v, dict):
            out[k] = {str(kk): finite(vv) for kk, vv in v.items()}
        elif isinstance(v, list):
            out[k] = [finite(x) for x in v]
        elif isinstance(v, float):
            out[k] = finite(v)
        else:
            out[k] = v
    return out


def markdown_report(out: dict) -> str:
    """The results file as Markdown: what was measured (model, data, windows, commit, command) and the tables."""
    lines = [
        f"# Coverage and overlap recall of the selected blocks: {', '.join(out['data'].get('sources', []))}",
        "",
        f"- model `{out['model']}`, {out['split']} split, {out['windows']} windows of {out['window']} tokens, last "
        f"{out['last']} measured, block {out['block_size']}, {out['activations']} activations",
        f"- budget B -> K = B // {out['block_size']} previous blocks + the query's own (the serving rule)",
        "- gates: " + (", ".join(f"{v} = `{out['gates'][g['gate']]}` (sink {g['sink_blocks']}, "
                                 f"local {g['local_blocks']}"
                                 + (f", prompt anchors {g['prompt_anchors']}" if g["prompt_anchors"] else "") + ")"
                                 for v, g in out["gate_variants"].items()) or "none"),
        f"- definitions: {out['definitions']}",
        f"- dense perplexity of the measured tokens {out['dense_ppl']:.3f}",
        f"- commit `{out['git']['commit'][:12]}`{' (with local changes)' if out['git']['dirty'] else ''}, "
        f"{out['seconds']:.0f} s",
        f"- command: `{out['command']}`",
        "",
        out["table_markdown"],
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
