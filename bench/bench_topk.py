"""Top-K block selection: Triton radix select vs torch.topk vs the sort-based reference.

    python bench/bench_topk.py [--k 64] [--sink 0] [--local 0]
    python bench/bench_topk.py --sweep --json DIR/topk-sweep.json   # phase-1 chunk widths, CUDA graphs
    python bench/bench_topk.py --sweep --dry-run --json X.json      # CPU: the sweep's plumbing, tiny

`--sweep` times `select_blocks_triton` in a CUDA graph (as the server runs it) at the serving shapes of
the first GPU run's trace (Qwen3-4B: 8 kv heads; M = context / 64 candidate blocks for 32K-256K; batch 1
and 8; K = 16, 32, 64 for budgets 1024-4096, sink 1 + local 1 forced) for the default chunk width and
each of `--chunks`, every answer checked against the reference: which width the Top-K should use (the
trace's 8.7 + 5.0 us a layer at 256K, batch 1, K 32 is the step's largest selector cost).

Rows (bs * H_kv) in {8, 64}, blocks per row M in {1024, 8192, 32768}, every block a candidate.
torch.topk is the floor a generic kernel reaches; it returns unordered indices and knows nothing
of forced blocks or the tie rule, so it does less work than `select_blocks`. Timings need a GPU
(triton.testing.do_bench); on a CPU-only machine this prints a note and exits 0.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import torch


def sweep(args) -> int:
    """The chunk-width sweep (see the module doc); writes --json, exit 1 on a wrong answer."""
    import json
    import time

    from sas_backend.ops.topk.naive import select_blocks
    from sas_backend.ops.topk.triton import _plan, select_blocks_triton, topk_workspace_numel

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if args.dry_run:  # CPU, interpreted: tiny rows, two widths
        shapes, ks, chunks, h_kv = [(1, 300)], [8], [None, 64], 2
    elif dev != "cuda":
        print("bench_topk --sweep: needs a CUDA GPU (--dry-run rehearses it on CPU)")
        return 2
    else:
        shapes, ks, chunks, h_kv = [(b, m) for b in (1, 8) for m in (512, 2048, 4096)], [16, 32, 64], \
            [None, *args.chunks], 8
    rows, bad = [], 0
    t0 = time.time()
    for bs, m in shapes:
        scores = torch.randn(bs, h_kv, m, device=dev)
        n_cand = torch.full((bs,), m, dtype=torch.int64, device=dev)
        for k in ks:
            want = select_blocks(scores, n_cand, k, 1, 1)
            for chunk in chunks:
                width = _plan(m, k, chunk)[0]
                out = torch.empty(bs, h_kv, k, dtype=torch.int32, device=dev)
                ws = torch.empty(max(1, topk_workspace_numel(bs, h_kv, m, k, chunk)), dtype=torch.int32, device=dev)

                def run():
                    select_blocks_triton(scores, n_cand, k, 1, 1, out=out, workspace=ws, chunk=chunk)

                run()
                ok = bool(torch.equal(out, want))
                bad += not ok
                if dev == "cuda":
                    import triton.testing

                    us = triton.testing.do_bench_cudagraph(run, rep=50) * 1e3
                else:
                    t = time.perf_counter()
                    run()
                    us = (time.perf_counter() - t) * 1e6
                rows.append({"batch": bs, "kv_heads": h_kv, "blocks": m, "k": k, "chunk": width,
                             "default": chunk is None, "us": round(us, 2), "exact": ok})
                print(f"[topk] bs {bs} M {m:5d} K {k:3d} chunk {width:5d}{' (default)' if chunk is None else ''}: "
                      f"{us:8.2f} us {'ok' if ok else 'WRONG'}", flush=True)
    rec = {"what": "select_blocks_triton per call (one layer), CUDA graph replay; sink 1 + local 1",
           "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu (dry run)",
           "rows": rows, "wall_s": round(time.time() - t0, 1)}
    if args.json:
        pathlib.Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(args.json).write_text(json.dumps(rec, indent=1) + "\n")
        table = ["| batch | blocks | K | chunk | us | exact |", "|---:|---:|---:|---:|---:|---|"]
        table += [f"| {r['batch']} | {r['blocks']} | {r['k']} | {r['chunk']}{' (default)' if r['default'] else ''} | "
                  f"{r['us']} | {'yes' if r['exact'] else 'NO'} |" for r in rows]
        pathlib.Path(args.json).with_suffix(".md").write_text(
            f"# Top-K chunk widths, {rec['device']}\n\n{rec['what']}\n\n" + "\n".join(table) + "\n")
        print(f"[topk] wrote {args.json} and its .md")
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=int, default=64, help="blocks selected per row (budget // block size)")
    ap.add_argument("--sink", type=int, default=0)
    ap.add_argument("--local", type=int, default=0)
    ap.add_argument("--sweep", action="store_true", help="time phase-1 chunk widths at serving shapes")
    ap.add_argument("--chunks", type=int, nargs="+", default=[128, 256, 512, 2048], help="widths besides the default")
    ap.add_argument("--dry-run", action="store_true", help="with --sweep: CPU, interpreted, tiny")
    ap.add_argument("--json", default=None, help="with --sweep: write the rows here")
    args = ap.parse_args()
    if args.sweep:
        return sweep(args)
    if not torch.cuda.is_available():
        print("bench_topk: no CUDA GPU here; Triton timings need a GPU to mean anything. Skipping.")
        return 0

    import triton.testing

    from sas_backend.ops.topk.naive import select_blocks
    from sas_backend.ops.topk.triton import select_blocks_triton

    print(f"device: {torch.cuda.get_device_name()}  K={args.k} sink={args.sink} local={args.local}")
    head = (
        f"{'rows':>5} {'M':>6} | {'triton us':>10} {'topk us':>9} {'naive us':>9} |"
        f" {'triton/topk':>11} {'triton/naive':>12}"
    )
    print(head)
    print("-" * len(head))
    for rows, (bs, h_kv) in ((8, (1, 8)), (64, (8, 8))):
        for m in (1024, 8192, 32768):
            scores = torch.randn(bs, h_kv, m, device="cuda")
            n_cand = torch.full((bs,), m, dtype=torch.int32, device="cuda")
            out = torch.empty(bs, h_kv, args.k, dtype=torch.int32, device="cuda")
            ref = select_blocks(scores, n_cand, args.k, args.sink, args.local)
            got = select_blocks_triton(scores, n_cand, args.k, args.sink, args.local, out=out)
            if not torch.equal(got, ref):
                print(f"MISMATCH rows={rows} M={m}", file=sys.stderr)
                return 1
            t_tri = triton.testing.do_bench(
                lambda: select_blocks_triton(scores, n_cand, args.k, args.sink, args.local, out=out)
            )
            t_topk = triton.testing.do_bench(lambda: torch.topk(scores, args.k, dim=-1))
            t_ref = triton.testing.do_bench(
                lambda: select_blocks(scores, n_cand, args.k, args.sink, args.local)
            )
            print(
                f"{rows:>5} {m:>6} | {t_tri * 1e3:>10.1f} {t_topk * 1e3:>9.1f} {t_ref * 1e3:>9.1f} |"
                f" {t_tri / t_topk:>11.2f} {t_tri / t_ref:>12.3f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
