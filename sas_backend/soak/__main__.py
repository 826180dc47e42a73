"""`python -m sas_backend.soak`: start a `sas` server with a small KV pool and soak it.

    python -m sas_backend.soak --requests 1000 --duration-min 20 --out bench/results/DATE-soak

Starts `python -m sglang.launch_server --attention-backend sas` (sas_backend.testing.server; the CPU engine
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
from sas_backend.provenance import portable_path
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


def portable_log(text: str) -> str:
    """The server log as a record may keep it: the checkout's own paths relative to it."""
    repo = source_checkout()
    return text.replace(f"{repo}/", "") if repo is not None else text


def soak_workload(args: argparse.Namespace, ids: list) -> tuple:
    """(WorkloadSpec, [SoakRequest]) of parsed arguments over the text's token ids `ids` (text_ids): the
    requests cut from all but the probes' tail."""
    spec = WorkloadSpec(requests=args.requests, duration_s=args.duration_min * 60, context_len=args.context_len,
                        max_new_tokens=args.max_new_tokens, seed=args.seed)
    return spec, make_workload(spec, ids[: len(ids) - sum(PROBE_LENGTHS)])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sas_backend.soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(default_model_dir()))
    p.add_argument("--backend", default="sas",
                   help="attention backend (sas; or a dense one, e.g. torch_native, to compare the same soak)")
    p.add_argument("--gate", default=None, help="gate checkpoint (default: the shipped one for the default model)")
    p.add_argument("--budget", type=int, default=1024,
                   help="--sas-budget (1024: prompts past 16 blocks decode sparsely)")
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--duration-min", type=float, default=20.0, help="arrivals spread over this many minutes")
    p.add_argument("--context-len", type=int, default=4096, help="--context-length of the server (the limit)")
    p.add_argument("--max-total-tokens", type=int, default=12288, help="KV pool size in tokens (small: pressure)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--schedule-conservativeness", type=float, default=0.1,
                   help="SGLang's admission reserve for future tokens (low: admit more, so decode runs the pool "
                        "dry and requests are retracted; SGLang's default is 1.0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rss-bound-mib", type=float, default=256.0,
                   help="fail if the server's RSS grows more than this after the first quarter of the arrivals "
                        "(warm-up: first-touch allocations)")
    p.add_argument("--rss-baseline", default=None, metavar="SOAK_JSON",
                   help="soak.json of a dense backend on the same workload: the bound becomes its growth after "
                        "warm-up plus --rss-bound-mib (SGLang's CPU scheduler grows by itself; "
                        "see docs/verification.md)")
    p.add_argument("--out", required=True, help="directory for soak.json and server.log")
    p.add_argument("--server-arg", action="append", default=[], help="one more launch argument (repeatable)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from sas_backend.testing.server import Server, launch_flags
    from sas_backend.soak.run import failures, soak

    gate = args.gate
    if gate is None:
        repo = source_checkout()
        gate = str((repo or pathlib.Path(".")) / "gate_checkpoints" / "smollm2-135m-instruct-sas")
    ids = text_ids(args.model)
    spec, workload = soak_workload(args, ids)
    baseline = None  # checked before the server starts: a wrong file loses no run
    if args.rss_baseline:
        base = json.loads(pathlib.Path(args.rss_baseline).read_text())
        if base.get("spec") != spec.__dict__:
            raise SystemExit(f"error: {args.rss_baseline} ran another workload ({base.get('spec')})")
        baseline = {"file": args.rss_baseline, "backend": base.get("backend"),
                    "growth_after_warmup": base["rss_bytes"]["growth_after_warmup"]}
    probes = probe_prompts(ids, args.context_len)
    sas_args = (["--sas-gate", gate, "--sas-budget", str(args.budget)] if args.backend == "sas"
                else ["--page-size", "64"])
    server_args = [*sas_args, "--context-length", str(args.context_len),
                   "--schedule-conservativeness", str(args.schedule_conservativeness), *args.server_arg]
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"[soak] {args.backend}: {args.requests} requests over {args.duration_min} min, context {args.context_len}, "
          f"KV pool {args.max_total_tokens} tokens, budget {args.budget}; starting the server", flush=True)
    last = [0.0]

    def progress(done, total, elapsed):
        if done == total or elapsed - last[0] >= 60:
            last[0] = elapsed
            print(f"[soak] {done}/{total} answered after {elapsed / 60:.1f} min", flush=True)

    started = time.time()
    # --max-total-tokens after the harness's own (argparse keeps the last)
    with Server(args.model, backend=args.backend,
                extra_args=server_args + ["--max-total-tokens", str(args.max_total_tokens)]) as server:
        report = soak(server, workload, probes, progress=progress)
        (out / "server.log").write_text(portable_log(server.log_text()))
    bound = int(args.rss_bound_mib * 2**20) + (max(0, baseline["growth_after_warmup"]) if baseline else 0)
    report["backend"] = args.backend
    bad = failures(report, bound)
    import sglang
    import torch

    from sas_backend import __version__

    report = {
        "what": f"soak through a real {args.backend} server: Poisson arrivals, streams cut by the client, "
                "over-limit requests, shared prefixes, a small KV pool",
        "date": datetime.date.today().isoformat(),
        "command": "python -m sas_backend.soak " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}",
        "versions": {"sas_backend": __version__, "sglang": sglang.__version__, "torch": torch.__version__},
        "spec": spec.__dict__,
        "server_args": [portable_path(a)
                        for a in launch_flags(server_args + ["--max-total-tokens", str(args.max_total_tokens)])],
        "rss_bound_bytes": bound, "rss_baseline": baseline, "total_wall_s": time.time() - started,
        "failures": bad, **report,
    }
    (out / "soak.json").write_text(json.dumps(report, indent=1) + "\n")
    s = report["summary"]
    print(f"[soak] {s['requests']} requests in {report['wall_s'] / 60:.1f} min: {s['results']}; "
          f"retracted {report['log']['retracted_requests']}, max queue {report['log']['max_queue']}; "
          f"probes equal {report['probes']['tokens_equal']}; decode steps "
          f"{report['pool_after_flush'].get('decode_steps')}; pages after flush "
          f"{report['pool_after_flush']['kv_pages']}; RSS growth {report['rss_bytes']['growth'] / 2**20:.1f} MiB "
          f"({report['rss_bytes']['growth_after_warmup'] / 2**20:.1f} after warm-up)")
    for b in bad:
        print(f"[soak] FAILED: {b}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
