"""Needle in a haystack through the real server: does a sparse decode still find one fact?

    .venv/bin/python bench/needle.py                 # dense + sas (gate, quest, sink-local) x budgets 512 1024 2048
    .venv/bin/python bench/needle.py --quick         # rehearsal: one depth, budget 512, gate only

A fact ("The secret passphrase of the <place> is <word>-<number>.") is placed at several depths of
~`--context` tokens of essay text (the default model's held-out-agnostic essays, `sas_backend.corpus`),
then a chat turn asks for it (OpenAI API, greedy, 24 tokens). One server at a time, as a user would run
them: dense (`--attention-backend torch_native`), then `--attention-backend sas` per selector and budget
(the shipped gate for `gate`). fp32 on CPU, like the other CPU benchmarks. A depth counts as recalled
when the answer contains the passphrase.

Note what a decode-only sparse backend changes here: the prompt (haystack + question) is prefilled
densely, so the first answer token comes from dense attention; every later token is decoded sparse.

Writes bench/results/needle-<date>[-quick].{json,md} (table, answers, model, gate, commit, command).
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import shlex
import sys
import time

import requests

from sas_backend.config import SASConfig
from sas_backend.corpus import read_essays
from sas_backend.provenance import git_state, repo_relative
from sas_backend.selection import selector_class, selector_names
from sas_backend.testing.server import DEFAULT_MODEL, Server, default_gate
from sas_backend.training.eval_ppl import parse_forced

REPO = pathlib.Path(__file__).resolve().parent.parent
NEEDLE = "The secret passphrase of the {place} is {code}."
QUESTION = "What is the secret passphrase of the {place}? Answer with the passphrase only."
PLACES = ["blue harbor", "old mill", "north tower", "silent garden", "copper bridge", "glass library"]
CODES = ["saffron-7412", "walnut-3958", "cobalt-6027", "juniper-1846", "marble-5391", "thistle-2764"]


def haystack_with_needle(tok, essay_text: str, context: int, depth: float, needle: str) -> str:
    """~`context` tokens of essay text with `needle` inserted at a sentence boundary near `depth`."""
    ids = tok(essay_text)["input_ids"][:context]
    text = tok.decode(ids)
    cut = int(len(text) * depth)
    dot = text.find(". ", cut)
    cut = len(text) if dot < 0 else dot + 2
    return text[:cut] + needle + " " + text[cut:]


REQUEST_TIMEOUT_S = 7200


def ask(url: str, prompt: str) -> str:
    body = {"model": "default", "messages": [{"role": "user", "content": prompt}], "max_tokens": 24,
            "temperature": 0.0}
    # A dense 32K prompt through SGLang's CPU extend took ~28 min on the quiet 2-core machine in 4096-token
    # chunks (8-11 min in one chunk), and longer when the machine is shared (the 32K study's first request
    # timed out at 1800 s beside a test run); the server's own watchdog (sas_backend.testing.server.CPU_WATCHDOG_S)
    # still ends a hung forward.
    r = requests.post(f"{url}/v1/chat/completions", json=body, timeout=REQUEST_TIMEOUT_S)
    r.raise_for_status()
    return r.json()["choices"][0]["message"]["content"]


def server_configs(args) -> list[tuple[str, str, list]]:
    """(name, backend, extra flags) of every server to run, dense first: the gate's serve default if
    asked, then each selector x budget (the gate once per --gate-forced setting, or with its record's)."""
    configs = [("dense", "torch_native", [])]
    forced = parse_forced(args.gate_forced)
    if args.serve_default:
        served = SASConfig(gate_path=args.gate).resolved()
        anchors = f", anchors {served.prompt_anchors}" if served.prompt_anchors else ""
        configs.append((f"sas gate serve default (b{served.budget}, sink {served.sink_blocks}, local "
                        f"{served.local_blocks}{anchors})", "sas", ["--sas-gate", args.gate]))
    anchored = args.prompt_anchors is not None
    for sel in args.selectors:
        for b in args.budgets:
            extra = (["--sas-selector", sel, "--sas-budget", str(b)]
                     + (["--sas-gate", args.gate] if selector_class(sel).needs_gate else []))
            anchors = ""
            if anchored and selector_class(sel).ranks:
                extra, anchors = extra + ["--sas-prompt-anchors", str(args.prompt_anchors)], f"+a{args.prompt_anchors}"
            for sink, local in (forced or [(None, None)]) if selector_class(sel).needs_gate else [(None, None)]:
                if sink is None:
                    configs.append((f"sas {sel}{anchors} b{b}", "sas", extra))
                else:
                    configs.append((f"sas {sel}+s{sink}l{local}{anchors} b{b}", "sas",
                                    extra + ["--sas-sink-blocks", str(sink), "--sas-local-blocks", str(local)]))
    return configs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--gate", default=None,
                    help="gate checkpoint (default: the one serve/serve.sh serves the model with)")
    ap.add_argument("--context", type=int, default=3072, help="haystack tokens")
    ap.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.3, 0.5, 0.7, 0.9])
    ap.add_argument("--budgets", type=int, nargs="+", default=[512, 1024, 2048])
    ap.add_argument("--selectors", nargs="+", default=list(selector_names()), choices=selector_names())
    ap.add_argument("--gate-forced", nargs="+", default=None, metavar="SINK,LOCAL",
                    help="gate servers with these forced blocks (e.g. 0,0 1,1) instead of the gate's serving record")
    ap.add_argument("--serve-default", action="store_true",
                    help="also a gate server launched with no budget or forced-block flags: what serve/serve.sh serves")
    ap.add_argument("--prompt-anchors", type=int, default=None, metavar="R",
                    help="gate and quest servers with --sas-prompt-anchors R (named +aR; default: the gate's record)")
    ap.add_argument("--server-arg", action="append", default=[],
                    help="one more launch argument for every server (repeatable; after the study's own, so it wins)")
    ap.add_argument("--tag", default="", help="suffix of the result files (needle-DATE-TAG.json/.md)")
    ap.add_argument("--quick", action="store_true", help="rehearsal: depth 0.5, budget 512, gate; not a result")
    ap.add_argument("--out", default=str(REPO / "bench" / "results"))
    ap.add_argument("--resume", default=None, metavar="PARTIAL_JSON",
                    help="a killed run's .partial.json (same model, context and depths): its answers are kept, "
                         "only the missing (server, depth) pairs run; the result keeps its date and name")
    ap.add_argument("--dense-from", default=None, metavar="NEEDLE_JSON",
                    help="take the dense server's answers from an earlier record of the same model, context and "
                         "depths instead of running it again (a study asking several gates the same prompts)")
    args = ap.parse_args(argv)
    args.gate = str(args.gate or default_gate(args.model))
    if args.quick:
        args.depths, args.budgets, args.selectors = [0.5], [512], ["gate"]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    tok.model_max_length = 1 << 30
    essays = read_essays()
    text = "\n\n".join(essays[k] for k in sorted(essays))
    cases = []
    for i, depth in enumerate(args.depths):
        place, code = PLACES[i % len(PLACES)], CODES[i % len(CODES)]
        hay = haystack_with_needle(tok, text, args.context, depth, NEEDLE.format(place=place, code=code))
        prompt = hay + "\n\n" + QUESTION.format(place=place)
        cases.append({"depth": depth, "code": code, "prompt_tokens": len(tok(prompt)["input_ids"]), "prompt": prompt})
    # the pool holds the whole prompt (the harness's CPU default is 16384 tokens)
    common = ["--dtype", "float32", "--context-length", str(args.context + 512),
              "--max-total-tokens", str(max(16384, args.context + 1024)), *args.server_arg]
    configs = server_configs(args)
    date = datetime.date.today().isoformat()
    tag = f"needle-{date}" + (f"-{args.tag}" if args.tag else "") + ("-quick" if args.quick else "")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    key = {"model": repo_relative(args.model), "context_tokens": args.context,
           "cases": [{k: v for k, v in c.items() if k != "prompt"} for c in cases]}
    done: dict[str, dict[float, dict]] = {}
    if args.resume:
        old = json.loads(pathlib.Path(args.resume).read_text())
        if {k: old.get(k) for k in key} != key:
            sys.exit(f"[needle] {args.resume} was made for another model, context or depths; not resuming")
        date, tag = old["date"], old["tag"]
        done = {r["server"]: {a["depth"]: a for a in r["answers"]} for r in old["rows"]}
    if args.dense_from:
        old = json.loads(pathlib.Path(args.dense_from).read_text())
        if {k: old.get(k) for k in key} != key:
            sys.exit(f"[needle] {args.dense_from} was made for another model, context or depths; not reusing it")
        done["dense"] = {a["depth"]: a for r in old["rows"] if r["server"] == "dense" for a in r["answers"]}
    partial = out / f"{tag}.partial.json"

    def save_partial(rows):  # a killed run (a session ending) keeps every answer so far
        partial.write_text(json.dumps({**key, "date": date, "tag": tag, "rows": rows}, indent=1))

    order = {c["depth"]: i for i, c in enumerate(cases)}
    rows = []
    started = time.time()
    for name, backend, extra in configs:
        answers = [done[name][c["depth"]] for c in cases if c["depth"] in done.get(name, {})]
        rows.append({"server": name, "answers": answers})
        if len(answers) == len(cases):
            print(f"[needle] {name}: every depth is in {args.resume or args.dense_from}; not run again", flush=True)
            continue
        print(f"[needle] starting {name} ...", flush=True)
        with Server(args.model, backend=backend, extra_args=common + extra) as server:
            for case in cases:
                if case["depth"] in done.get(name, {}):
                    continue
                t = time.time()
                answer = ask(server.url, case["prompt"])
                new = {"depth": case["depth"], "answer": answer, "recalled": case["code"] in answer,
                       "seconds": round(time.time() - t, 1)}
                answers.append(new)
                answers.sort(key=lambda a: order[a["depth"]])
                save_partial(rows)
                print(f"[needle] {name:18s} depth {case['depth']:g}: {'yes' if new['recalled'] else 'no ':3s} "
                      f"{answer!r} ({time.time() - t:.0f} s)", flush=True)

    head = "| server | " + " | ".join(f"depth {c['depth']:g}" for c in cases) + " | recalled |"
    lines = [head, "|" + "---|" * (len(cases) + 2)]
    for row in rows:
        hits = [a["recalled"] for a in row["answers"]]
        lines.append(f"| {row['server']} | " + " | ".join("yes" if h else "no" for h in hits)
                     + f" | {sum(hits)}/{len(hits)} |")
    table = "\n".join(lines)
    record = {
        "what": "needle in a haystack through the real server (OpenAI chat API, greedy)", "rehearsal": args.quick,
        "date": date, "commit": git_state()["commit"], "model": repo_relative(args.model),
        "gate": repo_relative(args.gate),
        "context_tokens": args.context, "server_flags": common, "rows": rows,
        "dense_answers_from": args.dense_from and repo_relative(args.dense_from),
        "cases": [{k: v for k, v in c.items() if k != "prompt"} for c in cases],
        "needle": NEEDLE, "question": QUESTION, "wall_s": round(time.time() - started, 1),
        "command": " ".join(shlex.quote(a)
                            for a in ["python", "bench/needle.py", *(sys.argv[1:] if argv is None else argv)]),
        "table_markdown": table,
    }
    (out / f"{tag}.json").write_text(json.dumps(record, indent=2))
    partial.unlink(missing_ok=True)
    (out / f"{tag}.md").write_text(f"# Needle in a haystack, {date}\n\n"
                                   f"{record['command']} (commit {record['commit']})\n\n{table}\n")
    print(table)
    print(f"[needle] wrote {out / (tag + '.json')} and {out / (tag + '.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
