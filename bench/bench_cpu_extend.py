"""CPU extend (prefill) attention: SGLang's torch-native extend vs sas's own, side by side, one layer.

    .venv/bin/python bench/bench_cpu_extend.py                  # contexts 8K 16K 32K, Qwen2.5-0.5B geometry
    .venv/bin/python bench/bench_cpu_extend.py --quick          # rehearsal: 4K, not a result

The `sas` backend runs extend attention on CPU itself (sas_backend/ops/extend) instead of delegating
to SGLang's torch-native backend, which pads each request's queries to its whole length. Two cases a
server meets at long context, per context L, both timed in this process on the same inputs:

  chunked prefill: a fresh L-token prompt in chunks of `--chunk` tokens (SGLang's CPU default 4096):
      chunk k extends a cached prefix of k * chunk tokens;
  radix hit:       `--hit` new tokens after a cached (L - hit)-token prefix (a shared prompt prefix).

One attention layer (H_q/H_kv/D of the model, fp32, its real K/V layout: a scrambled paged pool);
the model-wide figure multiplies by the layer count. Each timing is the best of `--repeats`. Both
outputs are compared (max |diff|). Writes bench/results/cpu-extend-<date>[-quick].{json,md}.
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import shlex
import sys
import time

import torch

from bench_cpu_decode import machine
from sas_backend.ops.extend import DEFAULT_METHOD, paged_extend_attention
from sas_backend.provenance import git_state

REPO = pathlib.Path(__file__).resolve().parent.parent


def pool(context: int, h_kv: int, d: int, seed: int = 0):
    """One layer's KV pool holding one request of `context` tokens at scrambled slots."""
    g = torch.Generator().manual_seed(seed)
    slots = context + 64
    k_cache = torch.randn(slots, h_kv, d, generator=g)
    v_cache = torch.randn(slots, h_kv, d, generator=g)
    req_to_token = torch.zeros(2, context, dtype=torch.int32)
    req_to_token[1] = (torch.randperm(slots, generator=g)[:context]).int()
    return k_cache, v_cache, req_to_token


def best_of(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def time_extends(extends, h_q, h_kv, d, k_cache, v_cache, r2t, repeats):
    """Seconds of SGLang's torch-native extend and of ours over `extends` [(prefix, new)], and the
    largest |difference| of their outputs."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    g = torch.Generator().manual_seed(1)
    scale = d**-0.5
    t_native = t_sas = diff = 0.0
    for p, e in extends:
        q = torch.randn(e, h_q, d, generator=g)
        theirs, ours = torch.empty_like(q), torch.empty_like(q)
        rows = torch.tensor([1])

        def native():
            TorchNativeAttnBackend._run_sdpa_forward_extend(
                None, q, theirs, k_cache, v_cache, r2t, rows, torch.tensor([p + e]), torch.tensor([p]),
                torch.tensor([e]), scaling=scale, enable_gqa=h_q != h_kv, causal=True)

        def sas():
            paged_extend_attention(q, ours, k_cache, v_cache, r2t, [1], [p], [e], scale)

        t_native += best_of(native, repeats)
        t_sas += best_of(sas, repeats)
        diff = max(diff, (theirs - ours).abs().max().item())
    return t_native, t_sas, diff


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", type=int, nargs="+", default=[8192, 16384, 32000])
    ap.add_argument("--chunk", type=int, default=4096, help="chunked prefill size (SGLang's CPU default 4096)")
    ap.add_argument("--hit", type=int, default=64, help="new tokens of the radix-hit case")
    ap.add_argument("--heads", type=int, nargs=3, default=[14, 2, 64], metavar=("H_Q", "H_KV", "D"),
                    help="attention geometry (default: Qwen2.5-Coder-0.5B's)")
    ap.add_argument("--layers", type=int, default=24, help="the model's layers, for the model-wide seconds")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="rehearsal: context 4096, one repeat; not a result")
    ap.add_argument("--out", default=str(REPO / "bench" / "results"))
    args = ap.parse_args(argv)
    if args.quick:
        args.contexts, args.repeats = [4096], 1
    h_q, h_kv, d = args.heads
    rows = []
    for L in args.contexts:
        k_cache, v_cache, r2t = pool(L, h_kv, d)
        cases = {
            f"chunked prefill ({args.chunk})": [(s, min(args.chunk, L - s)) for s in range(0, L, args.chunk)],
            f"radix hit (+{args.hit})": [(L - args.hit, args.hit)],
        }
        for name, extends in cases.items():
            t_n, t_s, diff = time_extends(extends, h_q, h_kv, d, k_cache, v_cache, r2t, args.repeats)
            row = {"context": L, "case": name, "extends": len(extends), "native_s": t_n, "sas_s": t_s,
                   "speedup": t_n / t_s, "model_native_s": t_n * args.layers, "model_sas_s": t_s * args.layers,
                   "max_abs_diff": diff}
            rows.append(row)
            print(f"[extend] L={L:6d} {name:24s} torch_native {t_n * 1e3:9.1f} ms  sas {t_s * 1e3:9.1f} ms  "
                  f"{row['speedup']:5.2f}x  (x{args.layers} layers: {row['model_native_s']:7.1f} s vs "
                  f"{row['model_sas_s']:7.1f} s)  max|diff| {diff:.1e}", flush=True)
    date = datetime.date.today().isoformat()
    stem = pathlib.Path(args.out) / f"cpu-extend-{date}{'-quick' if args.quick else ''}"
    stem.parent.mkdir(parents=True, exist_ok=True)
    table = ["| context | case | torch_native ms/layer | sas ms/layer | speedup "
             "| model s (torch_native / sas) | max abs diff |",
             "|---:|---|---:|---:|---:|---:|---:|"]
    table += [f"| {r['context']} | {r['case']} | {r['native_s'] * 1e3:.1f} | {r['sas_s'] * 1e3:.1f} | "
              f"{r['speedup']:.2f}x | {r['model_native_s']:.1f} / {r['model_sas_s']:.1f} | {r['max_abs_diff']:.1e} |"
              for r in rows]
    record = {"rows": rows, "geometry": {"h_q": h_q, "h_kv": h_kv, "head_dim": d, "layers": args.layers},
              "method": DEFAULT_METHOD, "chunk": args.chunk, "hit": args.hit, "repeats": args.repeats,
              "rehearsal": args.quick, "date": date,
              "machine": machine(), "git": git_state(),
              "command": "python bench/bench_cpu_extend.py " + shlex.join(sys.argv[1:] if argv is None else argv)}
    stem.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
    md = [f"# CPU extend attention, {date}", "", "`" + record["command"] + "`", "",
          f"One layer, H_q {h_q} / H_kv {h_kv} / D {d}, fp32, best of {args.repeats}, "
          f"sas method {DEFAULT_METHOD!r}; machine: {record['machine']['cpu']}, "
          f"{record['machine']['torch_threads']} threads, torch {record['machine']['torch']}.",
          "", *table, ""]
    stem.with_suffix(".md").write_text("\n".join(md))
    print("\n".join(table))
    print(f"[extend] wrote {stem}.json and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
