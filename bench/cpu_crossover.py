"""Where sparse decode starts to beat dense on a CPU at batch 1: dense and sas servers side by side, requests
alternated, so the drift of a shared machine (runs of bench_cpu_decode.py minutes apart differed by up to 30% on
the same dense point) hits every server alike.

    .venv/bin/python bench/cpu_crossover.py --contexts 1024 2048 3072 4096 6144 --budgets 512 2048 \\
        --dense-below 0 default --rounds 4

All servers are up at once, one decoding at a time: dense (`torch_native`) and one `sas` server per budget and
`--dense-below` value (the shipped gate, its other serving settings from its record): `0` is the sparse path
itself, `default` launches without the flag (the CPU default, to check it), N sets it.
Per context one prompt (essay tokens) is prefilled once into each server's radix cache; then R rounds, each
timing, server after server, a greedy request of N new tokens and one of 1 token from the cached prompt:
(t_N - t_1) / (N - 1) is the decode time per token (prefix hit, HTTP and the first token cancel). Per round the
ratio dense / sas (> 1: sas faster); the table gives the median and the range over rounds. The crossover of a
budget: the smallest context from which every larger one measured has a median ratio >= 1 (what the CPU default of
`--sas-dense-below`, budget + `config.CPU_DENSE_MARGIN`, is set from).

Writes <out>/cpu-crossover-<date>[-tag].json and .md (rows, machine, versions, commit, command).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import pathlib
import shlex
import statistics
import sys
import time

import requests

REPO = pathlib.Path(__file__).resolve().parent.parent
if str(REPO / "bench") not in sys.path:
    sys.path.insert(0, str(REPO / "bench"))

from bench_cpu_decode import COMMON_FLAGS, essay_ids, machine  # noqa: E402

from sas_backend.provenance import git_state, portable_argv, repo_relative  # noqa: E402
from sas_backend.testing.server import DEFAULT_MODEL, Server, default_gate  # noqa: E402


def timed_generate(url: str, prompt: list, new_tokens: int) -> float:
    """Seconds for one greedy /generate of `new_tokens` tokens (ignore_eos) from `prompt`."""
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0.0,
                                                     "ignore_eos": True}}
    t = time.perf_counter()
    r = requests.post(f"{url}/generate", json=body, timeout=3600)
    r.raise_for_status()
    return time.perf_counter() - t


def per_token_ms(url: str, prompt: list, new_tokens: int) -> float:
    """Decode milliseconds per token from a cached prompt: (t_N - t_1) / (N - 1)."""
    t1 = timed_generate(url, prompt, 1)
    tn = timed_generate(url, prompt, new_tokens)
    return (tn - t1) / (new_tokens - 1) * 1e3


def crossover(rows: list, key: str):
    """The smallest context from which every larger measured context has a median ratio >= 1 (None: none)."""
    found = None
    for row in sorted(rows, key=lambda r: -r["context"]):
        if row["sas"][key]["median_ratio"] < 1.0:
            break
        found = row["context"]
    return found


def server_key(budget: int, dense_below: str) -> str:
    """A sas server's key in the record: "<budget>/<--sas-dense-below value or default>"."""
    return f"{budget}/{dense_below}"


def markdown(record: dict) -> str:
    keys = list(record["sas_servers"])
    cols = " | ".join(f"b{k.replace('/', ' below ')} ms/token | dense/sas (range)" for k in keys)
    head = f"| context | dense ms/token | {cols} |"
    lines = [head, "|" + " ---: |" * (2 + 2 * len(keys))]
    for r in record["rows"]:
        cells = [str(r["context"]), f"{r['dense_ms']:.1f}"]
        for k in keys:
            s = r["sas"][k]
            cells += [f"{s['ms']:.1f}", f"{s['median_ratio']:.2f}x ({min(s['ratios']):.2f}-{max(s['ratios']):.2f})"]
        lines.append("| " + " | ".join(cells) + " |")
    cross = ", ".join(f"b{k.replace('/', ' below ')}: {record['crossover'][k] or 'none measured'}" for k in keys)
    return ("\n".join(lines) + f"\n\nColumns: budget, then `--sas-dense-below` (default: the flag not given). "
            f"Crossover (sas at least as fast from this context on): {cross}.\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--gate", default=None, help="gate checkpoint (default: the one serve/serve.sh serves)")
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048, 3072, 4096, 6144])
    ap.add_argument("--budgets", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--out", default=str(REPO / "bench" / "results"))
    ap.add_argument("--tag", default="")
    ap.add_argument("--dense-below", nargs="+", default=["0"], metavar="N|default",
                    help="the sas servers' --sas-dense-below, one server per budget and value: 0 (default: the "
                         "sparse path itself, to find the crossover), N, or `default` (no flag: the CPU default, "
                         "to check it)")
    args = ap.parse_args(argv)
    if args.new_tokens < 2:
        ap.error("--new-tokens must be at least 2")
    model = pathlib.Path(args.model)
    gate = pathlib.Path(args.gate) if args.gate else default_gate(model)
    ids = essay_ids(model)
    max_ctx = max(args.contexts) + args.new_tokens + 64
    flags = COMMON_FLAGS + ["--context-length", str(max_ctx), "--max-total-tokens",
                            str(max(16384, 2 * sum(args.contexts) + 4096))]
    bad = [v for v in args.dense_below if v != "default" and not v.isdigit()]
    if bad:
        ap.error(f"--dense-below takes token counts or `default`, got {' '.join(bad)}")
    servers = {"dense": ("torch_native", flags)}
    sas_servers = {}
    for b in args.budgets:
        for v in args.dense_below:
            dense_below = [] if v == "default" else ["--sas-dense-below", v]
            sas_servers[server_key(b, v)] = {"budget": b, "dense_below": v}
            servers[server_key(b, v)] = ("sas", flags + ["--sas-gate", str(gate), "--sas-budget", str(b), *dense_below])
    started, date = time.time(), datetime.date.today().isoformat()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = f"cpu-crossover-{date}" + (f"-{args.tag}" if args.tag else "")
    with contextlib.ExitStack() as stack:
        urls = {}
        for name, (backend, server_flags) in servers.items():
            print(f"[crossover] starting {name} ...", flush=True)
            urls[name] = stack.enter_context(Server(model, backend=backend, extra_args=server_flags)).url
        rows = []
        for i, ctx in enumerate(args.contexts):
            prompt = ids[i * 7000: i * 7000 + ctx]  # a fresh slice per context: no prefix shared across points
            if len(prompt) < ctx:
                sys.exit(f"the essays hold too few tokens for a {ctx}-token prompt at offset {i * 7000}")
            for url in urls.values():
                timed_generate(url, prompt, 1)  # prefill once: the rounds hit the radix cache
            ms = {name: [] for name in urls}
            for _ in range(args.rounds):
                for name, url in urls.items():
                    ms[name].append(per_token_ms(url, prompt, args.new_tokens))
            row = {"context": ctx, "dense_ms": statistics.median(ms["dense"]), "dense_rounds": ms["dense"], "sas": {}}
            for k in sas_servers:
                ratios = [d / s for d, s in zip(ms["dense"], ms[k])]
                row["sas"][k] = {"ms": statistics.median(ms[k]), "rounds": ms[k], "ratios": ratios,
                                 "median_ratio": statistics.median(ratios)}
            rows.append(row)
            print(f"[crossover] {ctx:6d} tokens: dense {row['dense_ms']:.1f} ms/token; " + ", ".join(
                f"b{k} {row['sas'][k]['median_ratio']:.2f}x" for k in sas_servers), flush=True)
    record = {"what": "decode ms per token at batch 1, dense vs sas servers (budget/--sas-dense-below), side by "
                      "side, requests alternated", "date": date, "machine": machine(), "git": git_state(),
              "command": shlex.join(["python", "bench/cpu_crossover.py", *portable_argv(sys.argv[1:])]),
              "model": repo_relative(model), "gate": repo_relative(gate), "server_flags": flags,
              "budgets": args.budgets, "sas_servers": sas_servers, "rounds": args.rounds,
              "new_tokens": args.new_tokens,
              "wall_s": round(time.time() - started, 1), "rows": rows,
              "crossover": {k: crossover(rows, k) for k in sas_servers}}
    (out / f"{tag}.json").write_text(json.dumps(record, indent=1))
    (out / f"{tag}.md").write_text(markdown(record))
    print(markdown(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
