"""Where gates' top-k selections fall short of the oracle's, read from held-out feature caches.

    .venv/bin/python bench/coverage_gap.py --model models/SmolLM2-135M-Instruct \
        --val-cache models/gen/cache/val-docs models/gen/cache/val-code \
        --gate shipped=gate_checkpoints/smollm2-135m-instruct-sas [--gate NAME=DIR ...] \
        [--budgets 512 1024 2048] [--sink-blocks 0 --local-blocks 0] [--json OUT.json]

Per gate and budget: the hard top-k coverage of the distillation target (each block's dense attention
mass, max over the kv group's heads: what `distill_cached` trains and logs held out) beside the
oracle's (the target's own k heaviest blocks), per layer; and how the shortfall spreads over the
(query, kv head) pairs: its quantiles and the share of it the worst 1/5/10/25% carry. A shortfall
spread thin is a ranking the whole distribution shares; one carried by few queries is a handful of
blocks the gate cannot see. Cached features only, no model forward: seconds on a CPU.
"""

from __future__ import annotations

import argparse
import json
import sys
from statistics import fmean
from typing import Dict, List, Optional

import torch

WORST = (0.01, 0.05, 0.10, 0.25)  # shares of the (query, head) pairs, worst first
QUANTILES = (0.5, 0.9, 0.99)


def gap_of(gate_dir: str, rows, spec, geometry, budgets: List[int], sink_blocks: int,
           local_blocks: int) -> Dict[str, dict]:
    """{budget: {"gate": [per-layer coverage], "oracle": [...], "quantiles": {q: shortfall},
    "worst_share": {fraction: share of the summed shortfall}}} of one gate on cached `rows`."""
    from sas_backend.gate.module import gates_from_tensors
    from sas_backend.geometry import gate_rope_table
    from sas_backend.training.distill_cached import RowBatch, layer_scores
    from sas_backend.training.model import oracle_topk_mass, per_query_coverage
    from sas_backend.training.cli import load_init_gate

    tensors, _ = load_init_gate(gate_dir, geometry, spec.block_size)
    gate_dim = int(tensors[0]["attngate_linear_q.weight"].shape[-1])
    gates = gates_from_tensors(tensors, range(geometry.num_layers), gate_dim=gate_dim)
    table = gate_rope_table(gate_dim, geometry, spec.seq_len)
    forced = sink_blocks + local_blocks
    picks = {b: b // spec.block_size - forced for b in budgets}
    per_layer = {b: {"gate": [], "oracle": []} for b in budgets}
    shortfall = {b: [] for b in budgets}
    with torch.no_grad():
        for layer, gate in gates.items():
            log_g, target, cand = layer_scores(gate, RowBatch(rows, layer, spec), spec, table,
                                               max(budgets) // spec.block_size, sink_blocks, local_blocks)
            for b, k in picks.items():
                got, has_prev = per_query_coverage(target, log_g, cand, k, 0.0)
                best = oracle_topk_mass(target, k)
                n = has_prev.sum().clamp_min(1)
                per_layer[b]["gate"].append(float((got * has_prev).sum() / n))
                per_layer[b]["oracle"].append(float((best * has_prev).sum() / n))
                shortfall[b].append((best - got)[has_prev].clamp_min(0))
    out = {}
    for b in budgets:
        gap = torch.cat(shortfall[b]).sort(descending=True).values
        total = float(gap.sum()) or 1.0
        quantiles = torch.quantile(gap[torch.linspace(0, len(gap) - 1, min(len(gap), 1 << 20)).long()],
                                   torch.tensor(QUANTILES))
        out[str(b)] = {**per_layer[b], "pairs": len(gap),
                       "quantiles": {str(q): round(float(v), 5) for q, v in zip(QUANTILES, quantiles)},
                       "worst_share": {str(f): round(float(gap[: max(1, int(f * len(gap)))].sum()) / total, 4)
                                       for f in WORST}}
    return out


def report(gaps: Dict[str, Dict[str, dict]], budgets: List[int]) -> str:
    """Markdown: mean coverage vs the oracle's and the shortfall's spread per gate and budget, then the
    per-layer coverage at the first budget."""
    lines = ["| gate | budget | coverage | oracle | shortfall median / p90 / p99 | share of it in the worst "
             + " / ".join(f"{int(100 * f)}%" for f in WORST) + " |", "|---|---|---|---|---|---|"]
    for name, gap in gaps.items():
        for b in budgets:
            g = gap[str(b)]
            lines.append(f"| {name} | {b} | {fmean(g['gate']):.4f} | {fmean(g['oracle']):.4f} | "
                         + " / ".join(f"{g['quantiles'][str(q)]:.3f}" for q in QUANTILES) + " | "
                         + " / ".join(f"{100 * g['worst_share'][str(f)]:.0f}%" for f in WORST) + " |")
    b = str(budgets[0])
    first = next(iter(gaps.values()))[b]
    lines += ["", f"Per layer at budget {b} (coverage; the oracle's last):", "",
              "| layer | " + " | ".join(gaps) + " | oracle |", "|---" * (len(gaps) + 2) + "|"]
    for layer in range(len(first["oracle"])):
        lines.append(f"| {layer} | " + " | ".join(f"{gap[b]['gate'][layer]:.3f}" for gap in gaps.values())
                     + f" | {first['oracle'][layer]:.3f} |")
    return "\n".join(lines)


def main(argv: Optional[list] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="the model directory the caches were made with")
    p.add_argument("--val-cache", nargs="+", required=True, help="held-out feature caches")
    p.add_argument("--gate", action="append", required=True, metavar="NAME=DIR", help="a gate checkpoint (repeatable)")
    p.add_argument("--budgets", type=int, nargs="+", default=[512, 1024, 2048])
    p.add_argument("--sink-blocks", type=int, default=0, help="forced first blocks (not ranked by the gate)")
    p.add_argument("--local-blocks", type=int, default=0, help="forced blocks before the query's own")
    p.add_argument("--json", help="write the numbers here")
    args = p.parse_args(argv)
    from sas_backend.geometry import ModelGeometry
    from sas_backend.provenance import portable_path
    from sas_backend.training.distill_cached import check_compatible
    from sas_backend.training.features import FeatureCacheError, load_feature_cache

    gates = dict(g.split("=", 1) if "=" in g else (g, g) for g in args.gate)
    try:
        caches = [load_feature_cache(c) for c in args.val_cache]
    except FeatureCacheError as e:
        raise SystemExit(f"error: {e}") from None
    check_compatible(list(zip(args.val_cache, caches)))
    spec = caches[0].spec
    forced = args.sink_blocks + args.local_blocks
    bad = [b for b in args.budgets if b % spec.block_size or b // spec.block_size <= forced]
    if bad:
        raise SystemExit(f"error: budgets {bad} are not multiples of the block size {spec.block_size} leaving the "
                         "gate picks beyond the forced blocks")
    geometry = ModelGeometry.from_model_dir(args.model)
    rows = [r for c in caches for r in c.rows]
    gaps = {name: gap_of(path, rows, spec, geometry, args.budgets, args.sink_blocks, args.local_blocks)
            for name, path in gates.items()}
    print(report(gaps, args.budgets))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"gates": {n: portable_path(p) for n, p in gates.items()},
                       "val_caches": [portable_path(c) for c in args.val_cache], "budgets": args.budgets,
                       "sink_blocks": args.sink_blocks, "local_blocks": args.local_blocks, "gaps": gaps}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
