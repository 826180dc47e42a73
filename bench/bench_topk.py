"""Top-K block selection: Triton radix select vs torch.topk vs the sort-based reference.

    python bench/bench_topk.py [--k 64] [--sink 0] [--local 0]

Rows (bs * H_kv) in {8, 64}, blocks per row M in {1024, 8192, 32768}, every block a candidate.
torch.topk is the floor a generic kernel reaches; it returns unordered indices and knows nothing
of forced blocks or the tie rule, so it does less work than `select_blocks`. Timings need a GPU
(triton.testing.do_bench); on a CPU-only machine this prints a note and exits 0.
"""

from __future__ import annotations

import argparse
import sys

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=int, default=64, help="blocks selected per row (budget // block size)")
    ap.add_argument("--sink", type=int, default=0)
    ap.add_argument("--local", type=int, default=0)
    args = ap.parse_args()
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
