"""Distill AttnGates from cached dense features (`sas_backend.training.features`).

The same objective as `train --objective distill` (KL of the gate's block distribution to the
pooled dense attention, per layer, forced sink/local blocks excluded and the target renormalized
over the others, as `model.training_attention` computes it), but the backbone never runs: each
step reads `--rows-per-step` cached rows and runs only the gate math (gate query, block summaries
from the pooled keys, `scoring.BlockLogGate`, `model.distill_kl`), one layer at a time. On a CPU
that is ~100x cheaper per row than a distill step of `train`, so a gate can see every cached row
many times.

    python -m sas_backend.training.distill_cached --model DIR --cache DIR [DIR ...] --out DIR
        [--budget 2048] [--sink-blocks 1] [--local-blocks 1] [--steps 500] [--rows-per-step 4]
        [--lr 2e-3] [--warmup 20] [--min-lr-ratio 0.1] [--init-gate DIR] [--seed 0]
        [--val-cache DIR [DIR ...]] [--eval-every 50] [--save-every 100] [--resume]
        [--coverage-weight 0] [--coverage-budgets 512 1024 2048] [--coverage-temperature 0.05] [--coverage-regret]
        [--layers I [I ...]]   # train only these layers' gates (needs --init-gate; the others are kept)
        [--sub-blocks N]       # gates for --sas-sub-blocks N: runs of block / N tokens, a block scores its best run

With `--sub-blocks N` the gate learns the serving rule of `selection.SelectionRule.sub_blocks`: each run of b / N
tokens is summarized on its own (RoPE at its first position) and a block's score is its best run's, inside the
softmax the KL fits (the gradient reaches that run). The caches must pool runs as fine or finer
(`features --sub-blocks M`, N dividing M); the checkpoint's `serving.sub_blocks` says N, so a server serves it so.

Several caches (e.g. prose, prose with recall rows, code) are one pool of rows; they must share
model, seq len, tail, block size and target. Every row is loaded into memory (fp16; ~47 MB a
4096-token row of SmolLM2-135M at tail 1024, so 145 rows take ~7 GB). Output: the canonical checkpoint
(config `training` = the record: caches and their data, steps, losses, held-out KL and top-k coverage beside
the oracle's, the ceiling), `train_state.pt` for `--resume`
(batches are a pure function of seed and step) and `train_log.jsonl`.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from sas_backend.ops import sub_blocks_ok

from sas_backend.training.cli import add_run_args, command_line, initial_gate, loss_record, schedule_record
from sas_backend.training.loop import STATE_FILE, GateLoop, batch_rows, progress_bar

# Arguments a resumed run must share with the run that wrote the state.
_RESUME_KEYS = ("model", "cache", "budget", "sink_blocks", "local_blocks", "steps", "rows_per_step", "lr",
                "warmup", "min_lr_ratio", "weight_decay", "clip", "seed", "init_gate", "gate_dim", "coverage_weight",
                "coverage_budgets", "coverage_temperature", "coverage_regret", "layers", "sub_blocks")
# What a state saved before a key existed ran with.
_RESUME_DEFAULTS = {"coverage_weight": 0.0, "coverage_budgets": [512, 1024, 2048], "coverage_temperature": 0.05,
                    "coverage_regret": False, "layers": None, "sub_blocks": 1}
_SPEC_KEYS = ("model", "num_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "seq_len", "tail",
              "block_size", "target")


class RowBatch:
    """Cached rows stacked for one layer: q `[R*N, Hq, D]`, pooled `[R*NBc*n, Hkv, 3D]` (n = spec.sub_blocks runs a
    block, regrouped from the cache's finer runs by `features.pool_runs`), target `[Hkv, R*N, NB]` (fp32), with the
    packed bookkeeping `BlockLogGate` needs."""

    def __init__(self, rows: List[Dict[str, torch.Tensor]], layer: int, spec):
        from sas_backend.training.features import pool_runs

        full = spec.seq_len // spec.block_size
        self.q = torch.cat([r[f"q.{layer}"] for r in rows]).float()
        self.pooled = torch.cat([pool_runs(r[f"pooled.{layer}"].float(), r[f"pooled.{layer}"].shape[0] // full,
                                           spec.sub_blocks) for r in rows])
        self.target = torch.cat([r[f"target.{layer}"] for r in rows], dim=1).float()
        n, length = len(rows), spec.seq_len
        self.bounds = [(i * length, (i + 1) * length) for i in range(n)]
        self.query_start = length - spec.tail


@dataclasses.dataclass(frozen=True)
class Coverage:
    """The optional top-k coverage term: `weight * sum_k (1 - soft coverage at k)` added to the KL,
    k = each budget's free picks (budget // block - forced blocks); `temperature` as
    `model.topk_coverage`. The KL fits the whole block distribution; this term spends the gradient
    on the ranking at the boundary each serving budget cuts. regret: `weight * sum_k` of the mean
    squared regret against the oracle's top k instead (`model.topk_regret`: the worst misses first)."""
    weight: float
    picks: tuple
    temperature: float
    regret: bool = False


def layer_scores(gate, batch: RowBatch, spec, gate_table: torch.Tensor, top_k: int, sink_blocks: int,
                 local_blocks: int):
    """(log_g `[Hkv, T, NB]`, target over the ranked blocks `[Hkv, T, NB]`, ranked blocks `[T, NB]`)
    of one layer on cached rows (log_g differentiable in `gate`)."""
    from sas_backend.training.model import target_over_candidates
    from sas_backend.training.scoring import candidate_blocks, score_with_summaries

    b, nb, full, n = spec.block_size, spec.num_blocks, spec.seq_len // spec.block_size, spec.sub_blocks
    n_rows = len(batch.bounds)
    starts = (torch.arange(full)[:, None] * b + torch.arange(n) * (b // n)).reshape(-1).repeat(n_rows)  # each run's
    kg = gate.summarize_pooled(batch.pooled, gate_table[starts]).view(n_rows, full, n, gate.num_kv_heads,
                                                                      gate.gate_dim).transpose(2, 3)
    kg = kg[:, :, :, 0] if n == 1 else kg  # [R, NBc, Hkv, Dg], or [R, NBc, Hkv, n, Dg]: a block scores its best run
    if nb > full:  # the incomplete last block never scores (zeros, as scoring.block_summaries pads)
        kg = torch.cat([kg, kg.new_zeros(n_rows, nb - full, *kg.shape[2:])], dim=1)
    scores = score_with_summaries(gate, batch.q, kg, batch.bounds, b, top_k, gate_table, query_chunk=spec.tail,
                                  query_start=batch.query_start, sink_blocks=sink_blocks, local_blocks=local_blocks)
    pos = torch.arange(batch.query_start, spec.seq_len).repeat(n_rows)  # each query's in-row position
    cand, _ = candidate_blocks(pos, nb, b, sink_blocks, local_blocks)
    return scores.log_g, target_over_candidates(batch.target, pos, b, sink_blocks, local_blocks), cand


def layer_loss(gate, batch: RowBatch, spec, gate_table: torch.Tensor, top_k: int, sink_blocks: int,
               local_blocks: int, coverage: Optional[Coverage] = None) -> torch.Tensor:
    """Mean per-query KL(target || gate) of one layer on cached rows (differentiable in `gate`),
    plus the coverage term when given.

    The distill loss of `model.training_attention` for one layer, computed from the cached
    pre-RoPE q, pooled keys and target instead of a model forward.
    """
    from sas_backend.training.model import distill_kl, topk_coverage, topk_regret

    log_g, target, cand = layer_scores(gate, batch, spec, gate_table, top_k, sink_blocks, local_blocks)
    loss = distill_kl(target, log_g)
    if coverage is not None and coverage.weight > 0:
        for k in coverage.picks:
            miss = (topk_regret(target, log_g, cand, k, coverage.temperature) if coverage.regret
                    else 1 - topk_coverage(target, log_g, cand, k, coverage.temperature))
            loss = loss + coverage.weight * miss
    return loss


def by_length(rows, spec, lengths: Optional[Sequence[int]] = None) -> List[Tuple[object, list, float]]:
    """`[(spec at length L, the rows of L tokens, their share of the rows)]`: caches of several row lengths (16K and
    32K rows) train together, each length stacked on its own (`RowBatch` needs one length) and weighted by its rows,
    so a step's loss is the mean over its rows as with one length. lengths: each row's tokens (None: spec's)."""
    if lengths is None:
        return [(spec, list(rows), 1.0)]
    groups: Dict[int, list] = {}
    for row, length in zip(rows, lengths):
        groups.setdefault(int(length), []).append(row)
    return [(dataclasses.replace(spec, seq_len=length), group, len(group) / len(rows))
            for length, group in sorted(groups.items())]


def mean_loss(gates, rows, spec, gate_table, top_k, sink_blocks, local_blocks,
              coverage: Optional[Coverage] = None, lengths: Optional[Sequence[int]] = None) -> float:
    """Sum over layers of the layer losses of `rows` (of `lengths` tokens each, `by_length`), accumulating each
    layer's gradient as it goes (layers are independent, so each graph is freed before the next is built)."""
    total = 0.0
    groups = by_length(rows, spec, lengths)
    for layer, gate in gates.items():
        for s, group, share in groups:
            loss = layer_loss(gate, RowBatch(group, layer, s), s, gate_table, top_k, sink_blocks, local_blocks,
                              coverage)
            if share != 1.0:
                loss = loss * share
            loss.backward()
            total += float(loss.detach())
    return total


def evaluate(gates, rows, spec, gate_table, top_k, sink_blocks, local_blocks, picks,
             lengths: Optional[Sequence[int]] = None) -> Tuple[float, Dict[int, float]]:
    """(sum over layers of the mean per-query KL, {k: hard top-k coverage of the target averaged
    over layers}) of `rows` (`by_length`), no gradient: the held-out numbers."""
    from sas_backend.training.model import distill_kl, topk_coverage

    kl, cov = 0.0, {k: 0.0 for k in picks}
    with torch.no_grad():
        for layer, gate in gates.items():
            for s, group, share in by_length(rows, spec, lengths):
                log_g, target, cand = layer_scores(gate, RowBatch(group, layer, s), s, gate_table, top_k,
                                                   sink_blocks, local_blocks)
                kl += float(distill_kl(target, log_g)) * share
                for k in picks:
                    cov[k] += float(topk_coverage(target, log_g, cand, k)) * share / len(gates)
    return kl, cov


def oracle_coverage(gates, rows, spec, gate_table, top_k, sink_blocks, local_blocks, picks,
                    lengths: Optional[Sequence[int]] = None) -> Dict[int, float]:
    """{k: hard top-k coverage of the target by its own top k (the oracle selector), averaged over
    layers} of `rows`: the ceiling the gates' held-out coverage (`evaluate`) is read against. The
    gates only lend their layers and geometry; their scores are not used."""
    from sas_backend.training.model import oracle_topk_mass

    cov = {k: 0.0 for k in picks}
    with torch.no_grad():
        for layer, gate in gates.items():
            for s, group, share in by_length(rows, spec, lengths):
                _, target, _ = layer_scores(gate, RowBatch(group, layer, s), s, gate_table, top_k,
                                            sink_blocks, local_blocks)
                has_prev = target.sum(-1) > 0
                for k in picks:
                    best = oracle_topk_mass(target, k)
                    cov[k] += float((best * has_prev).sum() / has_prev.sum().clamp_min(1)) * share / len(gates)
    return cov


def _coverage_text(entry: dict) -> str:
    return "top-k coverage " + " ".join(f"{b}: {v:.4f}" for b, v in entry["coverage"].items())


def check_compatible(caches) -> None:
    """Exit with an error unless every (path, cache) of `caches` was made with the same model, tail, block size and
    target (row lengths may differ: `by_length`)."""
    first = caches[0][1].manifest
    for path, cache in caches[1:]:
        diff = [k for k in _SPEC_KEYS if k != "seq_len" and cache.manifest.get(k) != first.get(k)]
        if cache.spec.sub_blocks != caches[0][1].spec.sub_blocks:
            diff.append("sub_blocks")
        if diff:
            raise SystemExit(f"error: cache {path} differs from {caches[0][0]} in {', '.join(diff)}")


def _train_split_only(caches) -> None:
    """Training caches hold training documents only: never a held-out split or an out-of-domain set."""
    from sas_backend.training.data import OUT_OF_DOMAIN

    for path, cache in caches:
        data = cache.manifest.get("data") or {}
        reserved = [s for s in data.get("sources", []) if s in OUT_OF_DOMAIN]
        if data.get("split", "train") != "train" or reserved:
            raise SystemExit(f"error: --cache {path} holds the {data.get('split')} split of {data.get('sources')}: "
                             f"train on training splits only (held-out and out-of-domain caches go to --val-cache)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sas_backend.training.distill_cached",
                                description="Distill AttnGates from cached dense features (no backbone forward).")
    p.add_argument("--model", required=True, help="the Hugging Face model directory the caches were made with")
    p.add_argument("--cache", required=True, nargs="+", help="feature cache directories (one pool of rows)")
    p.add_argument("--out", required=True, help="output directory (checkpoint, state, log)")
    p.add_argument("--budget", type=int, default=2048, help="the serving budget: K = budget // block (records it; "
                                                            "forced blocks must leave the gate some of K)")
    p.add_argument("--sink-blocks", type=int, default=1, help="first blocks forced in at serving (not ranked)")
    p.add_argument("--local-blocks", type=int, default=1, help="blocks before the query's own forced in (not ranked)")
    add_run_args(p, steps=500, lr=2e-3, save_every=100, state_file=STATE_FILE)
    p.add_argument("--rows-per-step", type=int, default=4, help="cached rows per optimizer step")
    p.add_argument("--coverage-weight", type=float, default=0.0,
                   help="add this weight x (1 - soft top-k coverage) per --coverage-budgets to the KL (0: KL only)")
    p.add_argument("--coverage-budgets", type=int, nargs="+", default=[512, 1024, 2048],
                   help="serving budgets whose top-k coverage is trained (with --coverage-weight) and logged held out")
    p.add_argument("--coverage-temperature", type=float, default=0.05,
                   help="sigmoid temperature (in log-gate units) of the soft top-k; SmolLM2's gates space their "
                        "6th and 7th best blocks 0.05-0.17 apart")
    p.add_argument("--coverage-regret", action="store_true",
                   help="the coverage term is the mean squared regret against the oracle's top k (the queries "
                        "that miss the most weigh most) instead of the mean missed mass")
    p.add_argument("--sub-blocks", type=int, default=1,
                   help="train gates for --sas-sub-blocks N (runs of block / N tokens, a block scores its best run; "
                        "the caches must pool runs of block / M, N dividing M); the checkpoint serves with N")
    p.add_argument("--layers", type=int, nargs="+", default=None,
                   help="train only these layers' gates (the others are kept from --init-gate); default all")
    p.add_argument("--val-cache", nargs="*", default=[],
                   help="held-out feature caches: their KL is logged, never trained on")
    p.add_argument("--eval-every", type=int, default=50, help="held-out KL every N steps (and at the end)")
    return p


def main(argv: Optional[list] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    from sas_backend.gate.checkpoint import save_gate_checkpoint
    from sas_backend.gate.module import gates_from_tensors
    from sas_backend.geometry import ModelGeometry, gate_rope_table
    from sas_backend.provenance import portable_path
    from sas_backend.training.features import FeatureCacheError, LazyRows, load_feature_cache
    from sas_backend.training.scoring import check_forced

    bad = [f"--{n.replace('_', '-')} must be >= 1" for n in ("steps", "rows_per_step", "budget", "eval_every")
           if getattr(args, n) < 1]
    if bad:
        raise SystemExit("error: " + "; ".join(bad))
    try:
        # training rows are read per step (a large training set does not fit in memory); held-out rows
        # are few and read every evaluation
        caches = [(c, load_feature_cache(c, lazy=True)) for c in args.cache]
        vals = [(c, load_feature_cache(c)) for c in args.val_cache]
    except FeatureCacheError as e:
        raise SystemExit(f"error: {e}") from None
    check_compatible(caches + vals)
    _train_split_only(caches)
    manifest = caches[0][1].manifest
    spec = caches[0][1].spec
    if not sub_blocks_ok(args.sub_blocks, spec.sub_blocks):
        raise SystemExit(f"error: --sub-blocks {args.sub_blocks}: the caches pool runs of block / {spec.sub_blocks} "
                         "tokens; train with a power of two dividing that (build caches with features --sub-blocks "
                         "for finer runs)")
    spec = dataclasses.replace(spec, sub_blocks=args.sub_blocks)  # the runs the gates score (RowBatch regroups)
    geometry = ModelGeometry.from_model_dir(args.model)
    got = (geometry.num_layers, geometry.num_q_heads, geometry.num_kv_heads, geometry.head_dim)
    want = tuple(manifest[k] for k in _SPEC_KEYS[1:5])
    if got != want:
        raise SystemExit(f"error: {args.model} has (layers, q heads, kv heads, head dim) {got}; the caches were made "
                         f"for {want}")
    if args.budget % spec.block_size:
        raise SystemExit(f"error: --budget {args.budget} is not a multiple of the cached block size {spec.block_size}")
    top_k = args.budget // spec.block_size
    try:
        check_forced(top_k, args.sink_blocks, args.local_blocks)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    forced = args.sink_blocks + args.local_blocks
    bad = [c for c in args.coverage_budgets if c % spec.block_size or c // spec.block_size <= forced]
    if bad or args.coverage_weight < 0 or args.coverage_temperature <= 0:
        raise SystemExit(f"error: --coverage-budgets must be multiples of the block size {spec.block_size} leaving the "
                         f"gate picks beyond the {forced} forced blocks (got {bad}); --coverage-weight >= 0 and "
                         "--coverage-temperature > 0")
    picks = {c: c // spec.block_size - forced for c in args.coverage_budgets}  # budget -> the gate's free picks
    coverage = Coverage(args.coverage_weight, tuple(picks.values()), args.coverage_temperature, args.coverage_regret)
    if args.layers is not None:
        bad_layers = sorted({i for i in args.layers if not 0 <= i < geometry.num_layers})
        if bad_layers or not args.init_gate:
            raise SystemExit(f"error: --layers must name layers 0..{geometry.num_layers - 1} (got {bad_layers}) and "
                             "needs --init-gate (the other layers' gates are kept from it)")
        args.layers = sorted(set(args.layers))
    rows = LazyRows([f for _, c in caches for f in c.rows.files])  # iterating would read every row
    val_rows = [r for _, c in vals for r in c.rows]
    seq_lens = sorted({c.spec.seq_len for _, c in caches + vals})
    row_lens = val_lens = None  # one length: every row is spec's
    if len(seq_lens) > 1:
        row_lens = [c.spec.seq_len for _, c in caches for _ in c.rows.files]
        val_lens = [c.spec.seq_len for _, c in vals for _ in c.rows]

    torch.manual_seed(args.seed)
    gate_config, tensors, init_record = initial_gate(args, geometry, spec.block_size)
    gates = gates_from_tensors(tensors, range(geometry.num_layers), gate_dim=gate_config.gate_dim)
    trained = {i: gates[i] for i in (args.layers or range(geometry.num_layers))}  # layers are independent
    for g in trained.values():
        g.requires_grad_(True)
    gate_table = gate_rope_table(gate_config.gate_dim, geometry, seq_lens[-1])
    params = [p for g in trained.values() for p in g.parameters()]
    loop = GateLoop(args, gates, params, resume_keys=_RESUME_KEYS, resume_defaults=_RESUME_DEFAULTS)
    start, end, losses = loop.start, loop.end, loop.losses
    val_log = list(loop.saved.get("val", []))

    oracle_cov = None  # the held-out rows' oracle coverage {budget: value}, measured at start (gate-independent)

    def held_out(step: int) -> Optional[float]:
        if not val_rows:
            return None
        kl, cov = evaluate(gates, val_rows, spec, gate_table, top_k, args.sink_blocks, args.local_blocks,
                           tuple(picks.values()), val_lens)
        val_log.append({"step": step, "kl": kl, "coverage": {str(c): round(cov[k], 5) for c, k in picks.items()}})
        return kl

    def record(step: int, elapsed: float) -> dict:
        return {
            "objective": "distill",
            "scope": None,
            "distill_target": spec.target,
            "method": "distillation of the oracle on cached dense features: KL(block attention "
                      f"{spec.target} of the dense attention, max over the group's heads || gate), forced blocks "
                      "excluded (sas_backend.training.distill_cached)"
                      + (f" + {args.coverage_weight} x "
                         + ("(the oracle's top-k coverage - the gate's soft one)^2" if args.coverage_regret
                            else "(1 - soft top-k coverage of the target)")
                         + f" at budgets {args.coverage_budgets} (temperature {args.coverage_temperature})"
                         if args.coverage_weight > 0 else ""),
            "coverage": {"weight": args.coverage_weight, "budgets": args.coverage_budgets,
                         "temperature": args.coverage_temperature,
                         **({"regret": True} if args.coverage_regret else {})} if args.coverage_weight > 0 else None,
            "budget": args.budget,
            "block_size": spec.block_size,
            **({"sub_blocks": args.sub_blocks} if args.sub_blocks > 1 else {}),
            "top_k": top_k,
            "sink_blocks": args.sink_blocks,
            "local_blocks": args.local_blocks,
            "data": {"caches": [{"cache": portable_path(p), "rows": c.manifest["rows"], "seed": c.manifest["seed"],
                                 "data": c.manifest["data"], "recall": c.manifest["recall"],
                                 "command": c.manifest.get("command")} for p, c in caches],
                     "rows": len(rows), "seq_len": spec.seq_len, "tail": spec.tail,
                     **({"seq_lens": seq_lens} if len(seq_lens) > 1 else {}),
                     "val_caches": [portable_path(p) for p, _ in vals]},
            "steps": step,
            "seq_len": spec.seq_len,
            "train_last": spec.tail,
            "rows_per_step": args.rows_per_step,
            "layers": args.layers,  # the layers trained here (None: all; the others come from init)
            "rows_seen": step * args.rows_per_step,
            **schedule_record(args),
            "init": init_record,
            **loss_record(losses, 20),
            "heldout_kl": val_log,
            "heldout_oracle_coverage": oracle_cov,
            "train_seconds": round(elapsed, 1),
            "command": command_line("sas_backend.training.distill_cached", argv),
        }

    def save(step: int, elapsed: float) -> None:
        loop.save_state(step, {"val": val_log})
        serving = {"sub_blocks": args.sub_blocks} if args.sub_blocks > 1 else gate_config.serving
        save_gate_checkpoint(args.out, dataclasses.replace(gate_config, training=record(step, elapsed),
                                                           serving=serving), gates, dtype=torch.float32)

    per_cache = ", ".join(f"{p}: {c.manifest['rows']}" for p, c in caches)
    print(f"[distill_cached] {len(rows)} cached rows ({per_cache}) "
          f"| tail {spec.tail} of {' / '.join(map(str, seq_lens))} | target {spec.target} "
          f"| budget {args.budget} (K={top_k}, "
          + (f"{args.sub_blocks} sub-block summaries a block, " if args.sub_blocks > 1 else "")
          + f"sink {args.sink_blocks}, local {args.local_blocks}) | {len(val_rows)} held-out rows "
          f"| steps {start}->{end}",
          flush=True)
    if val_rows:
        cov = oracle_coverage(gates, val_rows, spec, gate_table, top_k, args.sink_blocks, args.local_blocks,
                              tuple(picks.values()), val_lens)
        oracle_cov = {str(c): round(cov[k], 5) for c, k in picks.items()}
        print(f"[distill_cached] held-out oracle {_coverage_text({'coverage': oracle_cov})} (the best a selector "
              "of that many blocks covers)", flush=True)
    if start == 0 and val_rows:
        print(f"[distill_cached] held-out KL at step 0: {held_out(0):.4f}, {_coverage_text(val_log[-1])}", flush=True)
    bar = progress_bar(args.steps, "distill", initial=start, enabled=not args.no_progress)
    t_start = time.time()
    for step in range(start, end):
        t0 = time.time()
        idx = batch_rows(step, 0, 0, world=1, batch=args.rows_per_step, accum=1, n_rows=len(rows), seed=args.seed)
        loss = mean_loss(trained, [rows[i] for i in idx.tolist()], spec, gate_table, top_k, args.sink_blocks,
                         args.local_blocks, coverage=coverage,
                         lengths=None if row_lens is None else [row_lens[i] for i in idx.tolist()])
        lr_used, grad_norm = loop.step()
        done = step + 1
        seconds = time.time() - t0
        extra = {}
        if done % args.eval_every == 0 or done == args.steps:
            kl = held_out(done)
            if kl is not None:
                extra = {"heldout_kl": kl, "heldout_coverage": val_log[-1]["coverage"]}
        rec = loop.record(step, loss, lr_used, grad_norm, seconds, **extra)
        if bar is not None:
            bar.set_postfix(loss=f"{loss:.4f}", **({"val": f"{rec['heldout_kl']:.4f}"} if "heldout_kl" in rec else {}),
                            refresh=False)
            bar.update(1)
        elif done % 10 == 0 or "heldout_kl" in rec:
            print(f"[distill_cached] step {done}/{args.steps} loss {loss:.4f}"
                  + (f" held-out KL {rec['heldout_kl']:.4f}, {_coverage_text(val_log[-1])}" if "heldout_kl" in rec
                     else ""), flush=True)
        if loop.should_save(done):
            save(done, time.time() - t_start)
    if bar is not None:
        bar.close()
    if start >= end:
        print(f"[distill_cached] nothing to do: already at step {start} of {args.steps}", flush=True)
    else:
        print(f"[distill_cached] wrote {args.out} (step {end}, loss {losses[-1]:.4f}"
              + (f", held-out KL {val_log[-1]['kl']:.4f}" if val_log else "") + ")", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
