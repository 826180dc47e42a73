"""Forward+backward time and peak memory of the gated sparse-scope attention kernel, against the
materialized torch reference and dense causal SDPA (flash), on one sequence per size.

    python bench/bench_gated_attention.py [--sizes 4096 8192 16384 32768] [--budget 2048]

Setup: Hq=32, Hkv=8, D=128, bf16, block 64. The gates select K = budget // block previous
blocks per query (threshold = the K-th largest valid log-gate of the row; the serving rule), so with
its own block each query attends about `budget` + 64 tokens. Gate scores are shared along the sequence plus per-token
noise, so neighbouring queries mostly agree (as trained gates do) and tile skipping can work.
Peak memory is the extra over the inputs, for one forward+backward. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import torch
import torch.nn.functional as F

H_Q, H_KV, D, BLOCK = 32, 8, 128, 64


def make_inputs(seqlen: int, budget: int, dev: str = "cuda", seed: int = 0):
    """q `[T,Hq,D]`, k/v `[T,Hkv,D]` bf16; log_g `[Hkv,T,NB]` fp32; threshold `[Hkv,T]`; cu `[2]`."""
    g = torch.Generator(device=dev).manual_seed(seed)
    q = torch.randn(seqlen, H_Q, D, device=dev, generator=g, dtype=torch.bfloat16)
    k = torch.randn(seqlen, H_KV, D, device=dev, generator=g, dtype=torch.bfloat16)
    v = torch.randn(seqlen, H_KV, D, device=dev, generator=g, dtype=torch.bfloat16)
    nb = math.ceil(seqlen / BLOCK)
    own = torch.arange(seqlen, device=dev) // BLOCK
    valid = torch.arange(nb, device=dev)[None, :] < own[:, None]  # [T, NB]: previous blocks
    scores = 2 * torch.randn(H_KV, 1, nb, device=dev, generator=g)
    scores = scores + 0.5 * torch.randn(H_KV, seqlen, nb, device=dev, generator=g)
    log_g = torch.log_softmax(scores.masked_fill(~valid, float("-inf")), -1)
    log_g = log_g.masked_fill(~valid, 0.0)  # ignored by the op; keep it finite
    n_sel = budget // BLOCK  # K = budget / b previous blocks, as served
    ranked = log_g.masked_fill(~valid, float("-inf")).topk(min(n_sel, nb), dim=-1).values
    threshold = ranked[..., -1]  # the K-th largest: rows with fewer valid blocks take all (-inf)
    del ranked, scores
    cu = torch.tensor([0, seqlen], dtype=torch.int32, device=dev)
    return q, k, v, log_g, threshold, cu


def naive_bytes(seqlen: int) -> int:
    """Rough peak of the reference fwd+bwd: ~10 fp32 `[Hq, T, T]`-sized tensors (scores, bias,
    gathered gates, indices, softmax, and their grads)."""
    return 10 * 4 * H_Q * seqlen * seqlen


def measure(step, grads):
    """(ms, peak extra MiB) of one forward+backward, or None on OOM."""
    from triton.testing import do_bench

    result = None
    try:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
        for t in grads:
            t.grad = None
        result = (do_bench(step, grad_to_none=grads, warmup=3, rep=20), peak)
    except torch.cuda.OutOfMemoryError:
        pass
    for t in grads:  # outside the except, so the failed step's tensors are already released
        t.grad = None
    torch.cuda.empty_cache()
    return result


def run_size(seqlen: int, budget: int, skip_naive: bool):
    from sas_backend.training.ops.gated_attention import gated_attention, gated_attention_naive

    q, k, v, log_g, thr, cu = make_inputs(seqlen, budget)
    own = torch.arange(seqlen, device="cuda") // BLOCK
    prev_sel = ((log_g >= thr[..., None]) & (torch.arange(log_g.shape[2], device="cuda") < own[:, None]))
    attended = (prev_sel.sum(-1) * BLOCK + (torch.arange(seqlen, device="cuda") % BLOCK + 1)).float().mean().item()
    del prev_sel
    leaves = [x.requires_grad_() for x in (q, k, v, log_g)]
    do = torch.randn_like(q)

    def kernel_step():
        gated_attention(*leaves, thr, cu, BLOCK).backward(do)

    def naive_step():
        gated_attention_naive(*leaves, thr, cu, BLOCK).backward(do)

    # dense: flash SDPA over the group-expanded K/V (expansion outside the timed region)
    qd = q.detach().transpose(0, 1).unsqueeze(0).requires_grad_()
    kd = k.detach().repeat_interleave(H_Q // H_KV, 1).transpose(0, 1).unsqueeze(0).requires_grad_()
    vd = v.detach().repeat_interleave(H_Q // H_KV, 1).transpose(0, 1).unsqueeze(0).requires_grad_()
    dod = do.transpose(0, 1).unsqueeze(0)

    def dense_step():
        F.scaled_dot_product_attention(qd, kd, vd, is_causal=True).backward(dod)

    row = {"T": seqlen, "attended": attended}
    row["kernel"] = measure(kernel_step, leaves)
    row["dense"] = measure(dense_step, [qd, kd, vd])
    if skip_naive:
        row["naive"] = "skip"
    else:
        row["naive"] = measure(naive_step, leaves) or "OOM"
    return row


def fmt_row(row):
    def ms(x):
        return f"{x[0]:9.2f}" if isinstance(x, tuple) else f"{x or 'OOM':>9}"

    def mib(x):
        return f"{x[1]:9.0f}" if isinstance(x, tuple) else f"{'-':>9}"

    def ratio(a, b):
        ok = isinstance(a, tuple) and isinstance(b, tuple)
        return f"{a[0] / b[0]:8.2f}x" if ok else f"{'-':>9}"

    kern, naive, dense = row["kernel"], row["naive"], row["dense"]
    naive_ms = ms(naive) if naive != "skip" else f"{'skip/OOM':>9}"
    return (f"{row['T']:>6} {row['attended']:8.0f} | {ms(kern)} {naive_ms} {ms(dense)} | "
            f"{ratio(naive, kern)} {ratio(kern, dense)} | {mib(kern)} {mib(naive)} {mib(dense)}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--json", help="also write the rows (ms, peak MiB per variant) to this JSON file")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and exit (no CUDA needed)")
    args = ap.parse_args(argv)
    if args.dry_run:
        print(f"bench_gated_attention (dry run): sizes {args.sizes}, budget {args.budget}, Hq={H_Q} Hkv={H_KV} "
              f"D={D}; kernel vs naive (skipped above {0.8:.0%} of free memory) vs dense SDPA, fwd+bwd")
        return 0
    if not torch.cuda.is_available():
        print("bench_gated_attention: needs a CUDA GPU (Triton kernels, do_bench); skipping.")
        return 0
    free = torch.cuda.mem_get_info()[0]
    print(f"# {torch.cuda.get_device_name()}  Hq={H_Q} Hkv={H_KV} D={D} bf16 block={BLOCK} "
          f"budget={args.budget} (K={args.budget // BLOCK} previous blocks); fwd+bwd, one sequence")
    print(f"{'T':>6} {'attended':>8} | {'kernel ms':>9} {'naive ms':>9} {'dense ms':>9} | "
          f"{'naive/ker':>9} {'ker/dense':>9} | {'ker MiB':>9} {'naive MiB':>9} {'dense MiB':>9}")
    rows = []
    for seqlen in args.sizes:
        skip = naive_bytes(seqlen) > 0.8 * free  # the reference materializes [Hq, T, T]
        rows.append(run_size(seqlen, args.budget, skip))
        print(fmt_row(rows[-1]), flush=True)
        torch.cuda.empty_cache()
    print("# attended = mean keys per query; naive 'skip/OOM': estimated or actual OOM")
    if args.json:
        def entry(x):  # (ms, peak MiB) | None (OOM) | "skip"
            return {"ms": x[0], "peak_mib": x[1]} if isinstance(x, tuple) else (x or "OOM")

        record = {"device": torch.cuda.get_device_name(), "budget": args.budget, "block": BLOCK,
                  "heads": [H_Q, H_KV], "head_dim": D, "dtype": "bfloat16",
                  "rows": [{"T": r["T"], "attended": r["attended"],
                            **{k: entry(r[k]) for k in ("kernel", "naive", "dense")}} for r in rows]}
        with open(args.json, "w") as f:
            json.dump(record, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
