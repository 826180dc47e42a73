"""`python -m sas_backend.soak`: start a `sas` server with a small KV pool and soak it.

    python -m sas_backend.soak --requests 1000 --duration-min 20 --out bench/results/DATE-soak

Starts `python -m sglang.launch_server --attention-backend sas` (server_harness; the CPU engine
without a GPU) with `--context-length`, a KV pool of `--max-total-tokens` (small on purpose:
requests queue and get retracted) and the shipped gate at `--budget`, drives the workload
(workload.py), checks the server came back whole (run.py), writes `soak.json` (and the server log)
under `--out`, and exits 1 when a check fails. The CI-sized run is tests/server/test_soak.py.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import sys
import time

from sas_backend.paths import default_model_dir, source_checkout
from sas_backend.soak.workload import WorkloadSpec, make_workload

PROBE_LENGTHS = (40, 300, 1000, 2500)


def text_ids(model_dir) -> list:
    """Token ids of the essays (real English), concatenated."""
    from transformers import AutoTokenizer

    from sas_backend.corpus import read_essays

    texts = read_essays()
    if not texts:
        raise SystemExit("error: the essays are missing: run `python serve/prepare_text.py`")
    tok = AutoTokenizer.from_pretrained(model_dir)
    return tok("\n\n".join(texts[k] for k in sorted(texts)))["input_ids"]


def probe_prompts(ids: list, context_len: int) -> list:
    """Fixed prompts from the end of the text (the workload cuts from all of it; probes run alone)."""
    out, end = [], len(ids)
    for n in PROBE_LENGTHS:
        n = min(n, context_len - 64)
        out.append(ids[end - n:end])
        end -= n
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sas_backend.soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(default_model_dir()))
    p.add_argument("--gate", default=None, help="gate checkpoint (default: the shipped one for the default model)")
    p.add_argument("--budget", type=int, default=1024, help="--sas-budget (1024: prompts past 16 blocks decode sparsely)")
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--duration-min", type=float, default=20.0, help="arrivals spread over this many minutes")
    p.add_argument("--context-len", type=int, default=4096, help="--context-length of the server (the limit)")
    p.add_argument("--max-total-tokens", type=int, default=12288, help="KV pool size in tokens (small: pressure)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rss-bound-mib", type=float, default=256.0, help="fail if the server's RSS grows more")
    p.add_argument("--out", required=True, help="directory for soak.json and server.log")
    p.add_argument("--server-arg", action="append", default=[], help="one more launch argument (repeatable)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from sas_backend.server_harness import Server
    from sas_backend.soak.run import failures, soak

    gate = args.gate
    if gate is None:
        repo = source_checkout()
        gate = str((repo or pathlib.Path(".")) / "gate_checkpoints" / "smollm2-135m-instruct-sas")
    ids = text_ids(args.model)
    spec = WorkloadSpec(requests=args.requests, duration_s=args.duration_min * 60, context_len=args.context_len,
                        max_new_tokens=args.max_new_tokens, seed=args.seed)
    workload = make_workload(spec, ids[: len(ids) - sum(PROBE_LENGTHS)])
    probes = probe_prompts(ids, args.context_len)
    server_args = ["--sas-gate", gate, "--sas-budget", str(args.budget), "--context-length", str(args.context_len),
                   *args.server_arg]
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"[soak] {args.requests} requests over {args.duration_min} min, context {args.context_len}, "
          f"KV pool {args.max_total_tokens} tokens, budget {args.budget}; starting the server", flush=True)
    last = [0.0]

    def progress(done, total, elapsed):
        if done == total or elapsed - last[0] >= 60:
            last[0] = elapsed
            print(f"[soak] {done}/{total} answered after {elapsed / 60:.1f} min", flush=True)

    started = time.time()
    # --max-total-tokens after the harness's own (argparse keeps the last)
    with Server(args.model, backend="sas", extra_args=server_args + ["--max-total-tokens", str(args.max_total_tokens)]) as server:
        report = soak(server, workload, probes, progress=progress)
        (out / "server.log").write_text(server.log_text())
    bound = int(args.rss_bound_mib * 2**20)
    bad = failures(report, bound)
    import sglang
    import torch

    from sas_backend import __version__

    report = {
        "what": "soak through a real sas server: Poisson arrivals, streams cut by the client, over-limit requests, "
                "shared prefixes, a small KV pool",
        "date": datetime.date.today().isoformat(),
        "command": "python -m sas_backend.soak " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}",
        "versions": {"sas_backend": __version__, "sglang": sglang.__version__, "torch": torch.__version__},
        "spec": spec.__dict__, "server_args": server_args + ["--max-total-tokens", str(args.max_total_tokens)],
        "rss_bound_bytes": bound, "total_wall_s": time.time() - started,
        "failures": bad, **report,
    }
    (out / "soak.json").write_text(json.dumps(report, indent=1) + "\n")
    s = report["summary"]
    print(f"[soak] {s['requests']} requests in {report['wall_s'] / 60:.1f} min: {s['results']}; "
          f"retracted {report['log']['retracted_requests']}, max queue {report['log']['max_queue']}; "
          f"probes equal {report['probes']['tokens_equal']}; pages after flush "
          f"{report['pool_after_flush']['kv_pages']}; RSS growth {report['rss_bytes']['growth'] / 2**20:.1f} MiB")
    for b in bad:
        print(f"[soak] FAILED: {b}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
