"""What a PD decode server pays to recompute a transferred request's summaries, against the alternative of
transferring them (issue 65): one command, one machine, one run.

    .venv/bin/python bench/pd_recompute.py --gate gate_checkpoints/qwen2.5-coder-0.5b-instruct-sas \
        --contexts 8192 16384 32768 --sub-blocks 1 4 --out bench/results/2026-12-06-pd-recompute/qwen.json

A request whose KV arrives from a prefill server has no summaries on the decode side; at its first decode step
the backend summarizes every complete block in every sparse layer from the KV it holds
(`SASAttnBackend._summarize_unmarked` -> `DecodeStep.summarize_blocks`: the same call an extend through sas makes
for the blocks it completes, so the recompute is by construction one extend-summary pass). Timed here per context:

- `recompute`: that pass, all sparse layers, over the request's complete blocks (the gate's geometry and weights;
  random keys, fp32 as the CPU servers run);
- `dense step`: one dense decode step's attention over the same context, all layers (one query row per request:
  SDPA against the whole K and V), the yardstick a decode step is measured in;
- bytes: what the recompute reads (the request's K) and what transferring the summaries instead would carry
  (the summary rows of its pages at the pool's dtype) beside the K+V the transfer already moves.

Medians of `--repeats` runs on `--threads` threads, after one warm-up. Writes the JSON record and a Markdown table
beside it (`.md`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from sas_backend.gate.checkpoint import load_gate_checkpoint  # noqa: E402
from sas_backend.gate.module import gates_from_tensors  # noqa: E402
from sas_backend.ops.rope import apply_rope, rope_cos_sin_table  # noqa: E402
from sas_backend.provenance import git_state, portable_argv  # noqa: E402
from sas_backend.selection import SelectionRule, make_selector  # noqa: E402

BLOCK = 64


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gate", required=True, help="a gate checkpoint (its geometry and weights)")
    p.add_argument("--contexts", type=int, nargs="+", default=[8192, 16384, 32768])
    p.add_argument("--sub-blocks", type=int, nargs="+", default=[1], help="summaries a block (--sas-sub-blocks)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--summary-bytes", type=int, default=4, help="bytes a summary element (4 fp32, 2 bf16: CUDA)")
    p.add_argument("--kv-bytes", type=int, default=2, help="bytes a K/V element for the transfer figure (2: bf16)")
    p.add_argument("--out", default=None, help="the JSON record (and .md beside it)")
    return p.parse_args(argv)


def timed(fn, repeats: int) -> float:
    """Median seconds of `repeats` calls after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(gates: dict, cfg, ctx: int, sub_blocks: int, repeats: int, summary_bytes: int, kv_bytes: int) -> dict:
    """One context: the recompute pass and one dense decode step's attention, all layers, and the bytes."""
    g = torch.Generator().manual_seed(ctx)
    h_kv, h_q, d, dg = cfg.num_key_value_heads, cfg.num_attention_heads, cfg.head_dim, cfg.gate_dim
    layers = sorted(gates)
    pages = ctx // BLOCK  # the request's pages, in order from page 1 (page 0: SGLang's padding page)
    theta = cfg.rope_theta or 10000.0
    model_table = rope_cos_sin_table(d, ctx + BLOCK, theta)
    gate_table = rope_cos_sin_table(dg, ctx + BLOCK, theta)
    k_buffer = torch.zeros((pages + 1) * BLOCK, h_kv, d)
    k_buffer[BLOCK:] = apply_rope(torch.randn(ctx, h_kv, d, generator=g), model_table[:ctx])
    v_buffer = torch.randn_like(k_buffer)
    selector = make_selector("gate", SelectionRule(32, BLOCK, sub_blocks=sub_blocks))
    page_ids = torch.arange(1, pages + 1)
    starts = torch.arange(pages) * BLOCK

    def recompute():
        for lid in layers:
            selector.summarize(gates[lid], k_buffer, page_ids, starts, model_table, gate_table)

    q = torch.randn(1, h_q, 1, d, generator=g)
    k_ctx, v_ctx = k_buffer[BLOCK:].transpose(0, 1)[None], v_buffer[BLOCK:].transpose(0, 1)[None]

    def dense_step():
        for _ in layers:
            torch.nn.functional.scaled_dot_product_attention(q, k_ctx, v_ctx, scale=d**-0.5, enable_gqa=True)

    t_re, t_dense = timed(recompute, repeats), timed(dense_step, repeats)
    summary_dim = selector.summary_dim(d, dg)
    return {
        "context": ctx, "sub_blocks": sub_blocks, "pages": pages, "layers": len(layers),
        "recompute_s": t_re, "dense_step_s": t_dense, "recompute_in_dense_steps": t_re / t_dense,
        "k_bytes": len(layers) * ctx * h_kv * d * kv_bytes,
        "kv_transfer_bytes": 2 * len(layers) * ctx * h_kv * d * kv_bytes,
        "summary_transfer_bytes": len(layers) * pages * h_kv * summary_dim * summary_bytes,
    }


def machine() -> dict:
    """The CPU's model name and cores, Python and torch versions."""
    name = platform.processor() or platform.machine()
    try:
        name = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": name, "cores": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__}


def table(rows: list) -> str:
    lines = ["| context | summaries a block | recompute, all layers | one dense decode step | recompute / step | "
             "summaries a transfer would add | K+V the transfer moves |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['context']} | {r['sub_blocks']} | {r['recompute_s'] * 1e3:.1f} ms | "
                     f"{r['dense_step_s'] * 1e3:.2f} ms | {r['recompute_in_dense_steps']:.1f} | "
                     f"{r['summary_transfer_bytes'] / 2**20:.1f} MiB | {r['kv_transfer_bytes'] / 2**20:.0f} MiB |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg, tensors = load_gate_checkpoint(args.gate)
    gates = gates_from_tensors(tensors, sorted(tensors), gate_dim=cfg.gate_dim, device="cpu")
    rows = []
    for ctx in args.contexts:
        for sub in args.sub_blocks:
            row = measure(gates, cfg, ctx, sub, args.repeats, args.summary_bytes, args.kv_bytes)
            print(f"[pd-recompute] {ctx} tokens, {sub} a block: recompute {row['recompute_s'] * 1e3:.1f} ms = "
                  f"{row['recompute_in_dense_steps']:.1f} dense decode steps", flush=True)
            rows.append(row)
    md = table(rows)
    print(md)
    if args.out:
        out = pathlib.Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        record = {"rows": rows, "gate": args.gate, "threads": args.threads, "repeats": args.repeats,
                  "machine": machine(),
                  "date": datetime.date.today().isoformat(), "git": git_state(),
                  "command": " ".join(["python", "bench/pd_recompute.py", *portable_argv(sys.argv[1:])])}
        out.write_text(json.dumps(record, indent=1) + "\n")
        m, commit = record["machine"], record["git"].get("commit") or "?"
        where = f"{m['cpu']}, {m['cores']} cores, {args.threads} thread(s), torch {m['torch']}, {record['date']}"
        out.with_suffix(".md").write_text(f"{md}\n\n{where}, commit {commit[:7]}\n\n`{record['command']}`\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
