"""Tensor parallelism through the real server: `--tp-size N` equals `--tp-size 1` for the sas backend.

    .venv/bin/python bench/tp_check.py --model qwen2.5-coder-0.5b --tp 2 --context 16384
    .venv/bin/python bench/tp_check.py --model smollm2-135m --tp 3 --context 4096 --cpu-bind "0|1|0"

Starts a sas server at `--tp-size 1`, sends one greedy completion of `--context` essay tokens
(`--new-tokens` generated, logprobs and token ids returned, the selection log on), stops it, then
the same at `--tp-size N`. Compares greedy tokens, logprobs, and each rank's selection log (one per
rank, naming its global kv heads) with tp1's selection of those heads. One server at a time: on CPU
each rank needs its own OpenMP core set (`SGLANG_CPU_OMP_THREADS_BIND`, default: ranks spread over
this machine's cores), and a 16K prefill takes minutes.

The gate: --gate, else the shipped one that fits the model (serve/default_gate.py), else a
seeded-init gate. fp32 on CPU. Writes tp-<model>-tp<N>-<context>.{json,md} into --out
(default bench/results/<date>-tensor-parallel/).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import shlex
import subprocess
import sys
import tempfile
import time

import requests

from sas_backend.corpus import read_essays
from sas_backend.provenance import git_state
from sas_backend.testing.server import Server, cpu_threads_bind, default_gate

REPO = pathlib.Path(__file__).resolve().parent.parent


def model_dir(name_or_path: str) -> pathlib.Path:
    """A model directory, or one of the project's models by name (prepared if missing)."""
    path = pathlib.Path(name_or_path)
    if (path / "config.json").is_file():
        return path
    script = [sys.executable, str(REPO / "serve" / "prepare_model.py"), "--model", name_or_path]
    printed = subprocess.run(script + ["--print-out"], check=True, capture_output=True, text=True).stdout
    out = pathlib.Path(printed.strip())
    if not (out / "config.json").is_file():
        subprocess.run(script, check=True)
    return out


def selection_log(debug_dir: pathlib.Path) -> dict:
    """{tuple(global kv heads): [record per decode step]}, one file per rank."""
    out = {}
    for f in sorted(debug_dir.glob("*.jsonl")):
        recs = [json.loads(line) for line in f.open()]
        if recs:
            out[tuple(recs[0]["kv_heads"])] = recs
    return out


def run_one(model, gate, tp, prompt, args, cpu_bind) -> dict:
    """One server at `--tp-size tp`: the completion, the selection logs, timings."""
    debug = pathlib.Path(tempfile.mkdtemp(prefix=f"sas-tp{tp}-"))
    flags = ["--sas-gate", gate, "--sas-budget", str(args.budget), "--tp-size", str(tp), "--dtype", "float32",
             "--max-total-tokens", str(max(16384, args.context + 512)), "--context-length", str(args.context + 512)]
    env = {"SAS_DEBUG_DIR": str(debug)}
    if tp > 1:
        env["SGLANG_CPU_OMP_THREADS_BIND"] = cpu_bind
    t0 = time.time()
    with Server(model, backend="sas", extra_args=flags, env=env, startup_timeout=1800) as s:
        started = time.time() - t0
        body = {"model": "default", "prompt": prompt, "max_tokens": args.new_tokens, "temperature": 0.0,
                "logprobs": 1, "return_token_ids": True}
        t1 = time.time()
        r = requests.post(f"{s.url}/v1/completions", json=body, timeout=7200)
        r.raise_for_status()
        choice = r.json()["choices"][0]
        took = time.time() - t1
    print(f"[tp_check] tp {tp}: startup {started:.0f}s, request {took:.0f}s, tokens {choice['token_ids']}", flush=True)
    return dict(tp=tp, token_ids=choice["token_ids"], logprobs=choice["logprobs"]["token_logprobs"],
                selections=selection_log(debug), startup_s=round(started, 1), request_s=round(took, 1))


def compare(ref: dict, run: dict) -> dict:
    """Greedy tokens, worst |logprob difference|, and per rank: steps whose selection equals tp1's."""
    worst = max(abs(a - b) for a, b in zip(ref["logprobs"], run["logprobs"]))
    if not ref["selections"]:  # the budget covers the context: every step decoded densely, nothing logged
        raise SystemExit("tp1 logged no sparse decode step: the budget covers the context (raise --context)")
    (ref_heads, ref_steps), = ref["selections"].items()
    ranks = {}
    for heads, steps in sorted(run["selections"].items()):
        cols = [ref_heads.index(h) for h in heads]
        same = sum(
            rec["selected"][0] == [want["selected"][0][c] for c in cols] for rec, want in zip(steps, ref_steps)
        )
        ranks[",".join(map(str, heads))] = dict(steps=len(steps), equal_to_tp1=same)
    return dict(tokens_equal=ref["token_ids"] == run["token_ids"], max_abs_logprob_diff=worst, ranks=ranks,
                ranks_cover_all_heads=sorted(h for hs in run["selections"] for h in hs) == list(ref_heads))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b", help="model directory or project model name")
    ap.add_argument("--gate", default=None, help="gate checkpoint (default: the one serve/serve.sh would use)")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--context", type=int, default=16384, help="prompt tokens (essay text)")
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--cpu-bind", default=None, help="SGLANG_CPU_OMP_THREADS_BIND for the tp run (default: "
                    "the machine's cores split over the ranks, or shared round-robin when fewer)")
    ap.add_argument("--out", default=None, help="results folder (default bench/results/<date>-tensor-parallel)")
    args = ap.parse_args(argv)

    model = model_dir(args.model)
    gate = pathlib.Path(args.gate) if args.gate else default_gate(model)
    cpu_bind = args.cpu_bind or cpu_threads_bind(args.tp)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    ids = tok("\n\n".join(read_essays().values()))["input_ids"]
    if len(ids) < args.context:
        raise SystemExit(f"the essays hold {len(ids)} tokens of this tokenizer, fewer than --context {args.context}")
    prompt = ids[: args.context]
    print(f"[tp_check] {model.name}, gate {gate}, {args.context} prompt tokens, budget {args.budget}, "
          f"tp 1 vs {args.tp} (bind {cpu_bind})", flush=True)
    ref = run_one(model, gate, 1, prompt, args, cpu_bind)
    run = run_one(model, gate, args.tp, prompt, args, cpu_bind)
    result = dict(
        model=model.name, gate=str(gate.relative_to(REPO)) if gate.is_relative_to(REPO) else gate.name,
        context=args.context, budget=args.budget, tp=args.tp, cpu_bind=cpu_bind,
        comparison=compare(ref, run), runs=[{k: v for k, v in r.items() if k != "selections"} for r in (ref, run)],
        command="bench/tp_check.py " + shlex.join(argv if argv is not None else sys.argv[1:]),
        git=git_state(), date=datetime.date.today().isoformat(), machine=f"{os.cpu_count()} CPU cores",
    )
    out = pathlib.Path(args.out or REPO / "bench" / "results" / f"{datetime.date.today().isoformat()}-tensor-parallel")
    out.mkdir(parents=True, exist_ok=True)
    stem = f"tp-{model.name}-tp{args.tp}-{args.context}"  # names hold dots (Qwen2.5): no with_suffix
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
    c = result["comparison"]
    lines = [f"# `--tp-size {args.tp}` vs 1, sas, {model.name}, {args.context} tokens, budget {args.budget}", "",
             f"- greedy tokens equal: **{c['tokens_equal']}** ({args.new_tokens} tokens)",
             f"- max |logprob difference|: **{c['max_abs_logprob_diff']:.2e}**",
             f"- ranks' kv heads cover all heads: {c['ranks_cover_all_heads']}", "",
             "| rank's kv heads | decode steps | selection equal to tp1's |", "| --- | --- | --- |"]
    lines += [f"| {h} | {r['steps']} | {r['equal_to_tp1']} |" for h, r in c["ranks"].items()]
    lines += ["", f"Command: `{result['command']}` ({result['date']}, {result['machine']}, "
                  f"commit {result['git']['commit'][:10]})", ""]
    (out / f"{stem}.md").write_text("\n".join(lines))
    print("\n".join(lines))
    ok = c["tokens_equal"] and c["max_abs_logprob_diff"] < 2e-3 and c["ranks_cover_all_heads"]
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
