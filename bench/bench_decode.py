"""Steady-state decode latency per token: dense vs sas, same SGLang build, same model, one run.

For each backend a real server is started (`python -m sglang.launch_server`), then for each
context length and batch size, `batch` concurrent streaming requests of `context` random prompt
tokens each generate `--new-tokens` tokens (ignore_eos); the inter-token latency is the mean gap
between streamed chunks after the first. Prints a table with the sas/dense ratio and writes JSON.

    python bench/bench_decode.py --model Qwen/Qwen3-8B --gate /path/gate --contexts 8192 32768 131072 --batch 1 8
    python bench/bench_decode.py   # CPU smoke run on the default model (numbers mean nothing for speed)

On GPU the dense baseline is FlashInfer with CUDA graphs (SGLang's default); on CPU torch_native.
Before each point its prompts are prefilled once (1 token) into the radix cache, so the timed
requests decode together instead of waiting for each other's prefill. `--shared-prefix`: the
batch's prompts share all but their last 64 tokens (long contexts at batch 8 fit the KV pool and
the prefill is paid once; each request still attends its whole context). `--report`: also write
a Markdown summary and a PNG beside the JSON, with the environment (device, driver, versions, commit).
The GPU tier 2 (gpu_kit/run.py) drives this with a Qwen3-4B-shaped model and random weights.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import pathlib
import platform
import random
import statistics
import sys
import time

import requests

from sas_backend.testing.report import parse_points, write_json_atomic
from sas_backend.testing.server import DEFAULT_MODEL, Server

REPO = pathlib.Path(__file__).resolve().parent.parent


def _stream_itl(url: str, prompt: list, new_tokens: int) -> float:
    body = {
        "model": "default", "prompt": prompt, "max_tokens": new_tokens, "temperature": 0.0,
        "stream": True, "ignore_eos": True,
    }
    stamps = []
    with requests.post(f"{url}/v1/completions", json=body, stream=True, timeout=3600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                stamps.append(time.perf_counter())
    gaps = [b - a for a, b in zip(stamps[1:], stamps[2:])]  # skip the prefill's first token
    return statistics.mean(gaps) if gaps else float("nan")


def random_prompts(context, batch, vocab, seed, shared_prefix=False) -> list:
    """`batch` prompts of `context` random token ids; with shared_prefix all but the last 64 are common."""
    rng = random.Random(seed)
    if not shared_prefix:
        return [[rng.randrange(100, vocab) for _ in range(context)] for _ in range(batch)]
    head = [rng.randrange(100, vocab) for _ in range(max(context - 64, 0))]
    return [head + [rng.randrange(100, vocab) for _ in range(context - len(head))] for _ in range(batch)]


def measure(url, context, batch, new_tokens, vocab, seed, shared_prefix=False) -> float:
    prompts = random_prompts(context, batch, vocab, seed, shared_prefix)
    for p in prompts:  # prefill into the radix cache, outside the timing
        body = {"model": "default", "prompt": p, "max_tokens": 1, "temperature": 0.0}
        requests.post(f"{url}/v1/completions", json=body, timeout=3600).raise_for_status()
    with concurrent.futures.ThreadPoolExecutor(batch) as pool:
        itls = list(pool.map(lambda p: _stream_itl(url, p, new_tokens), prompts))
    return statistics.median(itls) * 1000.0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--gate", help="gate checkpoint (default: serve/default_gate.py's choice)")
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 6144])
    ap.add_argument("--batch", type=int, nargs="+", default=[1])
    ap.add_argument("--points", nargs="+", metavar="CTXxBS",
                    help="(context, batch) points instead of every context x batch, e.g. 8192x1 32768x8")
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--shared-prefix", action="store_true", help="prompts of a point share all but 64 tokens")
    ap.add_argument("--report", action="store_true", help="also write .md and .png beside the JSON")
    ap.add_argument("--dry-run", action="store_true", help="print the servers and points, start nothing")
    ap.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more server flags (both backends)")
    ap.add_argument("--out", default=str(REPO / "bench" / "results"))
    args = ap.parse_args(argv)

    points = [(c, b) for c in args.contexts for b in args.batch]
    if args.points:
        try:
            points = parse_points(args.points)
        except ValueError:
            ap.error(f"--points takes CONTEXTxBATCH, got {args.points}")
        args.contexts, args.batch = sorted({c for c, _ in points}), sorted({b for _, b in points})
    import torch

    on_gpu = torch.cuda.is_available()
    gate = args.gate
    if gate is None:
        import subprocess

        gate = subprocess.check_output(
            [sys.executable, str(REPO / "serve" / "default_gate.py"), "--model", args.model], text=True
        ).strip()
    max_ctx = max(args.contexts) + args.new_tokens + 64
    common = ["--page-size", "64", "--context-length", str(max_ctx)]
    if not on_gpu:
        per_point = (max_ctx + (max(args.batch) - 1) * (args.new_tokens + 128) if args.shared_prefix
                     else max_ctx * max(args.batch))
        common += ["--max-total-tokens", str(max(16384, per_point + 4096))]
    backends = {
        "dense": ("flashinfer" if on_gpu else "torch_native", common),
        "sas": ("sas", common + ["--sas-gate", gate, "--sas-budget", str(args.budget)]),
    }
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(args.model).vocab_size
    if args.dry_run:
        for name, (backend, flags) in backends.items():
            print(f"[bench] would start {name}: --attention-backend {backend} {' '.join(map(str, flags + args.extra))}")
        print(f"[bench] points (context x batch): {points}, "
              f"{args.new_tokens} new tokens, vocab {vocab}, shared prefix {args.shared_prefix}")
        return 0
    import sglang

    import sas_backend

    device = torch.cuda.get_device_name() if on_gpu else f"CPU ({platform.processor() or platform.machine()})"
    record = {
        "date": datetime.date.today().isoformat(), "device": device, "model": pathlib.Path(args.model).name,
        "gate": pathlib.Path(gate).name, "budget": args.budget, "new_tokens": args.new_tokens,
        "shared_prefix": args.shared_prefix, "server_flags": [str(f) for f in common + args.extra],
        "sglang": sglang.__version__, "torch": torch.__version__, "sas_backend": sas_backend.__version__, "rows": [],
        "complete": False,  # True once both servers ran every point
    }
    if args.report:
        from sas_backend.testing.report import environment

        record["environment"] = environment()
    out = pathlib.Path(args.out)
    path = out / f"decode-{'gpu' if on_gpu else 'cpu'}-{record['date']}.json"
    results = {}

    def save():
        """The record as measured so far (a point's row before the sas server reached it has sas_ms None),
        rewritten whole after every point: a run killed at its deadline keeps what it measured."""
        record["rows"] = rows_of(results)
        write_json_atomic(path, record)
        if args.report:
            write_report(record, path, plot=record["complete"])

    for name, (backend, flags) in backends.items():
        print(f"[bench] starting {name} ({backend}) ...", flush=True)
        with Server(args.model, backend=backend, extra_args=flags + args.extra) as server:
            measure(server.url, 256, 1, 4, vocab, seed=0)  # warm-up
            for ctx, bs in points:
                ms = measure(server.url, ctx, bs, args.new_tokens, vocab, seed=ctx, shared_prefix=args.shared_prefix)
                results.setdefault((ctx, bs), {})[name] = ms
                print(f"[bench] {name:5s} context {ctx:7d} batch {bs:3d}: {ms:8.2f} ms/token", flush=True)
                save()

    print(f"\nDecode latency per token, {pathlib.Path(args.model).name}, budget {args.budget}, {device}")
    print("| context | batch | dense ms/token | sas ms/token | sas / dense |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for r in rows_of(results):
        print(f"| {r['context']} | {r['batch']} | {r['dense_ms']:.2f} | {r['sas_ms']:.2f} | {r['ratio']:.2f} |")
    record["complete"] = True
    save()
    print(f"[bench] wrote {path}")
    return 0


def rows_of(results: dict) -> list:
    """{(context, batch): {"dense": ms, "sas": ms}} -> the record's rows, sorted; a backend not yet measured at a
    point has None (and so has the ratio)."""
    rows = []
    for (ctx, bs), r in sorted(results.items()):
        dense, sas = r.get("dense"), r.get("sas")
        rows.append({"context": ctx, "batch": bs, "dense_ms": dense, "sas_ms": sas,
                     "ratio": sas / dense if sas is not None and dense else None})
    return rows


def write_report(record: dict, path: pathlib.Path, plot: bool = True) -> None:
    """The .md (and with `plot` the .png: sas/dense per context) of `record` (its environment in) beside `path`."""
    from sas_backend.testing.report import env_markdown, md_table, pyplot, write_atomic

    rows = record["rows"]
    table = md_table(["context", "batch", "dense ms/token", "sas ms/token", "sas / dense"],
                     [[r["context"], r["batch"], r["dense_ms"], r["sas_ms"], r["ratio"]] for r in rows])
    partial = "" if record.get("complete", True) else "- **partial record**: the run ended before its last point\n"
    write_atomic(path.with_suffix(".md"),
                 f"# End-to-end decode latency, {record['model']}, budget {record['budget']}\n\n"
                 f"{env_markdown(record['environment'])}\n- server flags (both): {' '.join(record['server_flags'])}\n"
                 f"{partial}\n{table}\n")
    plt = pyplot() if plot else None
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, bs in enumerate(sorted({r["batch"] for r in rows})):
        rs = sorted((r for r in rows if r["batch"] == bs), key=lambda r: r["context"])
        x = [r["context"] for r in rs]
        ax.plot(x, [r["dense_ms"] for r in rs], "o--", color=f"C{i}", label=f"dense, batch {bs}")
        ax.plot(x, [r["sas_ms"] for r in rs], "s-", color=f"C{i}", label=f"sas, batch {bs}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("ms per decode step")
    ax.set_title(f"{record['model']}, budget {record['budget']}, {record['device']}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=120)


if __name__ == "__main__":
    sys.exit(main())
