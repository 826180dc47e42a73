"""Steady-state decode latency per token: dense vs sas, same SGLang build, same model, one run.

For each backend a real server is started (`python -m sglang.launch_server`), then for each
context length and batch size, `batch` concurrent streaming requests of `context` random prompt
tokens each generate `--new-tokens` tokens (ignore_eos); the inter-token latency is the mean gap
between streamed chunks after the first. Prints a table with the sas/dense ratio and writes JSON.

    python bench/bench_decode.py --model Qwen/Qwen3-8B --gate /path/gate --contexts 8192 32768 131072 --batch 1 8
    python bench/bench_decode.py   # CPU smoke run on the default model (numbers mean nothing for speed)

On GPU the dense baseline is FlashInfer with CUDA graphs (SGLang's default); on CPU torch_native.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import pathlib
import platform
import random
import statistics
import sys
import time

import requests

from sas_backend.server_harness import DEFAULT_MODEL, Server

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


def measure(url, context, batch, new_tokens, vocab, seed) -> float:
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, vocab) for _ in range(context)] for _ in range(batch)]
    with concurrent.futures.ThreadPoolExecutor(batch) as pool:
        itls = list(pool.map(lambda p: _stream_itl(url, p, new_tokens), prompts))
    return statistics.median(itls) * 1000.0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--gate", help="gate checkpoint (default: serve/default_gate.py's choice)")
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 6144])
    ap.add_argument("--batch", type=int, nargs="+", default=[1])
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more server flags (both backends)")
    ap.add_argument("--out", default=str(REPO / "bench" / "results"))
    args = ap.parse_args(argv)

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
        common += ["--max-total-tokens", str(max(16384, max_ctx * max(args.batch) + 4096))]
    backends = {
        "dense": ("flashinfer" if on_gpu else "torch_native", common),
        "sas": ("sas", common + ["--sas-gate", gate, "--sas-budget", str(args.budget)]),
    }
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(args.model).vocab_size
    results = {}
    for name, (backend, flags) in backends.items():
        print(f"[bench] starting {name} ({backend}) ...", flush=True)
        with Server(args.model, backend=backend, extra_args=flags + args.extra) as server:
            measure(server.url, 256, 1, 4, vocab, seed=0)  # warm-up
            for ctx in args.contexts:
                for bs in args.batch:
                    ms = measure(server.url, ctx, bs, args.new_tokens, vocab, seed=ctx + bs)
                    results.setdefault((ctx, bs), {})[name] = ms
                    print(f"[bench] {name:5s} context {ctx:7d} batch {bs:3d}: {ms:8.2f} ms/token", flush=True)

    device = torch.cuda.get_device_name() if on_gpu else f"CPU ({platform.processor() or platform.machine()})"
    print(f"\nDecode latency per token, {pathlib.Path(args.model).name}, budget {args.budget}, {device}")
    print("| context | batch | dense ms/token | sas ms/token | sas / dense |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    rows = []
    for (ctx, bs), r in sorted(results.items()):
        ratio = r["sas"] / r["dense"]
        print(f"| {ctx} | {bs} | {r['dense']:.2f} | {r['sas']:.2f} | {ratio:.2f} |")
        rows.append({"context": ctx, "batch": bs, "dense_ms": r["dense"], "sas_ms": r["sas"], "ratio": ratio})
    import sglang

    import sas_backend

    record = {
        "date": datetime.date.today().isoformat(), "device": device, "model": args.model, "gate": gate,
        "budget": args.budget, "new_tokens": args.new_tokens, "sglang": sglang.__version__,
        "torch": torch.__version__, "sas_backend": sas_backend.__version__, "rows": rows,
    }
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"decode-{'gpu' if on_gpu else 'cpu'}-{record['date']}.json"
    path.write_text(json.dumps(record, indent=2))
    print(f"[bench] wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
