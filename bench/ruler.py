"""RULER through the real server with lm-evaluation-harness: dense vs `sas`, on the tasks lm-eval generates.

    .venv/bin/pip install -e '.[eval]'        # lm-eval[api,ruler] (not in the test install)
    .venv/bin/python bench/ruler.py --lengths 4096 --limit 3
    .venv/bin/python bench/ruler.py --model models/Qwen2.5-Coder-0.5B-Instruct --lengths 16384 --limit 2

One server at a time, as a user runs them: dense (`--attention-backend torch_native` on CPU), `sas` at the
gate's serve default (its `serving` record), and `sas` at each `--budgets` value; each server is asked by
`lm_eval --model local-completions` (its OpenAI completions endpoint, greedy, the tasks' own generation
lengths). Each length is its own lm_eval run: lm-eval's --limit takes the first N documents, and with several
lengths generated at once those are all of the first length.

Tasks (lm-eval 0.4.13 `ruler`), all generated locally from the model's own tokenizer: niah_single_1
(repeated-noise haystack), niah_multikey_2 / niah_multikey_3 (a haystack of distractor needles, number and
uuid values), ruler_vt (variable tracking), ruler_cwe (common words), ruler_fwe (frequent words). Left out
because their data is downloaded: niah_single_2/3, niah_multikey_1, niah_multivalue, niah_multiquery (Paul
Graham essays fetched over HTTP) and ruler_qa_squad / ruler_qa_hotpot (SQuAD / HotpotQA from the Hub).

Writes OUT/ruler-<date>[-TAG].{json,md}: each server's score per task and length (RULER's string match,
0-1), its answer to every sample (target, response, score), the lm_eval command, versions, seconds; a killed run
resumes from its .partial.json (--resume).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import pathlib
import shlex
import subprocess
import sys
import tempfile
import time

from sas_backend.provenance import git_state, portable_argv, repo_relative
from sas_backend.testing.server import DEFAULT_MODEL, Server, default_gate

REPO = pathlib.Path(__file__).resolve().parent.parent
LOCAL_TASKS = ["niah_single_1", "niah_multikey_2", "niah_multikey_3", "ruler_vt", "ruler_cwe", "ruler_fwe"]
DOWNLOADED_TASKS = ["niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multivalue", "niah_multiquery",
                    "ruler_qa_squad", "ruler_qa_hotpot"]


def server_configs(gate: str, budgets: list[int], sas_args: tuple = ()) -> list[tuple[str, str, list]]:
    """(name, backend, extra flags) of every server, dense first, then the gate's serve default, then the gate
    at each budget (its record's forced blocks): bench/needle.py's list, so the two studies name servers alike.
    sas_args: more launch flags for the sas servers only, named in their rows."""
    import needle  # bench/ is the script's directory, so on sys.path

    configs = needle.server_configs(argparse.Namespace(gate=gate, gate_forced=None, serve_default=True,
                                                       selectors=["gate"], budgets=budgets, prompt_anchors=None))
    if not sas_args:
        return configs
    return [(f"{name} {' '.join(sas_args)}", backend, [*extra, *sas_args]) if backend == "sas"
            else (name, backend, extra) for name, backend, extra in configs]


def lm_eval_cmd(model: str, url: str, tasks: list[str], length: int, limit: int, out_dir: str) -> list[str]:
    """The lm_eval command line for one server and one length (what a user runs against their server)."""
    model_args = (f"model={model},base_url={url}/v1/completions,tokenizer={model},tokenized_requests=False,"
                  f"max_length={length},num_concurrent=1,timeout=7200")
    return [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", model_args,
            "--tasks", ",".join(tasks), "--limit", str(limit),
            "--metadata", json.dumps({"max_seq_lengths": [length], "pretrained": model}),
            "--output_path", out_dir, "--seed", "0", "--log_samples"]


def read_scores(out_dir: str, tasks: list[str], length: int) -> dict[str, float]:
    """task -> RULER score at `length` from lm_eval's results_*.json under `out_dir`."""
    files = sorted(pathlib.Path(out_dir).rglob("results_*.json"))
    if not files:
        raise RuntimeError(f"lm_eval wrote no results under {out_dir}")
    results = json.loads(files[-1].read_text())["results"]
    missing = [t for t in tasks if f"{length},none" not in results.get(t, {})]
    if missing:
        raise RuntimeError(f"lm_eval's results lack {missing} at length {length}: {files[-1]}")
    return {t: float(results[t][f"{length},none"]) for t in tasks}


def read_samples(out_dir: str, tasks: list[str], length: int) -> dict[str, list[dict]]:
    """task -> its samples' {doc_id, target, response, score} from lm_eval's samples_<task>_*.jsonl (--log_samples):
    what each server answered, so a changed score can be read as a changed answer."""
    out = {}
    for task in tasks:
        files = sorted(pathlib.Path(out_dir).rglob(f"samples_{task}_*.jsonl"))
        if not files:
            raise RuntimeError(f"lm_eval wrote no samples of {task} under {out_dir} (--log_samples)")
        rows = []
        for line in files[-1].read_text().splitlines():
            ex = json.loads(line)
            resp = ex["filtered_resps"][0]
            rows.append({"doc_id": ex["doc_id"], "target": ex["target"],
                         "response": resp[0] if isinstance(resp, list) else resp, "score": ex.get(str(length))})
        out[task] = sorted(rows, key=lambda r: r["doc_id"])
    return out


def mean_score(scores: dict[str, float], tasks: list[str]) -> float:
    """A server's mean score over the tasks run (each RULER's string match, 0-1)."""
    return sum(scores[t] for t in tasks) / len(tasks)


def tasks_differing(rows: list[dict], tasks: list[str], length: str) -> dict[str, int]:
    """server -> how many of `tasks` it scores differently from the dense server at `length` (dense: 0); empty
    without a dense score at that length."""
    dense = next((r["scores"].get(length) for r in rows if r["server"] == "dense"), None)
    if dense is None:
        return {}
    return {r["server"]: sum(abs(r["scores"][length][t] - dense[t]) > 1e-9 for t in tasks)
            for r in rows if length in r["scores"]}


def table_markdown(rows: list[dict], tasks: list[str], lengths: list[int]) -> str:
    """One row per server and length, a column per task, the mean over tasks and how many differ from dense."""
    lines = ["| server | length | " + " | ".join(tasks) + " | mean | tasks != dense |", "|" + "---|" * (len(tasks) + 4)]
    for length in map(str, lengths):
        differ = tasks_differing(rows, tasks, length)
        for row in rows:
            scores = row["scores"].get(length)
            if scores is None:
                continue
            diff = "" if row["server"] == "dense" or row["server"] not in differ else \
                f"{differ[row['server']]} of {len(tasks)}"
            lines.append(f"| {row['server']} | {length} | " + " | ".join(f"{scores[t]:.2f}" for t in tasks)
                         + f" | {mean_score(scores, tasks):.2f} | {diff} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--gate", default=None, help="gate checkpoint (default: the one serve/serve.sh serves)")
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096])
    ap.add_argument("--tasks", nargs="+", default=LOCAL_TASKS, choices=LOCAL_TASKS)
    ap.add_argument("--limit", type=int, default=3, help="samples per task and length (lm-eval generates 500)")
    ap.add_argument("--budgets", type=int, nargs="*", default=[512], help="sas servers besides the serve default")
    ap.add_argument("--server-arg", action="append", default=[], help="one more launch argument for every server")
    ap.add_argument("--sas-arg", action="append", default=[],
                    help="one more launch argument for the sas servers only (e.g. --sas-arg=--sas-sub-blocks "
                         "--sas-arg=4); named in their rows")
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", default=str(REPO / "bench" / "results"))
    ap.add_argument("--resume", default=None, metavar="PARTIAL_JSON", help="a killed run's .partial.json")
    args = ap.parse_args(argv)
    try:
        lm_eval_version = importlib.metadata.version("lm-eval")
    except importlib.metadata.PackageNotFoundError:
        sys.exit("[ruler] lm-eval is not installed: pip install -e '.[eval]' (lm-eval[api,ruler])")
    args.gate = str(args.gate or default_gate(args.model))
    context = max(args.lengths)
    common = ["--context-length", str(context), "--max-total-tokens", str(max(16384, context + 1024)),
              *args.server_arg]
    date = datetime.date.today().isoformat()
    tag = f"ruler-{date}" + (f"-{args.tag}" if args.tag else "")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    key = {"model": repo_relative(args.model), "tasks": args.tasks, "limit": args.limit}
    done: dict[str, dict] = {}
    if args.resume:
        old = json.loads(pathlib.Path(args.resume).read_text())
        if {k: old.get(k) for k in key} != key:
            sys.exit(f"[ruler] {args.resume} was made for another model, tasks or limit; not resuming")
        date, tag = old["date"], old["tag"]
        done = {r["server"]: r for r in old["rows"]}
    partial = out / f"{tag}.partial.json"
    rows, started = [], time.time()
    code = git_state()  # the code the servers run: taken now, as the tree may change during an hours-long run
    for name, backend, extra in server_configs(args.gate, args.budgets, tuple(args.sas_arg)):
        row = done.get(name, {"server": name, "launch": portable_argv(map(str, extra)), "scores": {}, "seconds": {}})
        rows.append(row)
        todo = [n for n in args.lengths if str(n) not in row["scores"]]
        if not todo:
            continue
        print(f"[ruler] starting {name} ...", flush=True)
        with Server(args.model, backend=backend, extra_args=common + extra) as server:
            for length in todo:
                t = time.time()
                with tempfile.TemporaryDirectory(prefix="ruler-") as tmp:
                    cmd = lm_eval_cmd(args.model, server.url, args.tasks, length, args.limit, tmp)
                    subprocess.run(cmd, check=True)
                    row["scores"][str(length)] = read_scores(tmp, args.tasks, length)
                    row.setdefault("samples", {})[str(length)] = read_samples(tmp, args.tasks, length)
                row["seconds"][str(length)] = round(time.time() - t, 1)
                # per row: a resumed run's record holds rows that ran on other code
                row["commit"], row["dirty_at_start"] = code["commit"], code["dirty"]
                partial.write_text(json.dumps({**key, "date": date, "tag": tag, "rows": rows}, indent=1))
                print(f"[ruler] {name} at {length}: {row['scores'][str(length)]} ({row['seconds'][str(length)]} s)",
                      flush=True)
    table = table_markdown(rows, args.tasks, args.lengths)
    # the command as a user types it: repository paths, a placeholder port and output folder
    shown = ["python", *lm_eval_cmd(repo_relative(args.model), "http://127.0.0.1:PORT", args.tasks, max(args.lengths),
                                    args.limit, "OUT")[1:]]
    argv_shown = sys.argv[1:] if argv is None else argv
    record = {
        "what": "RULER (lm-evaluation-harness, local-completions) through the real server", **key,
        "date": date, "tag": tag, "commit": code["commit"], "dirty_at_start": code["dirty"],
        "gate": repo_relative(args.gate),
        "lengths": args.lengths, "server_flags": common, "lm_eval": lm_eval_version,
        "tasks_left_out": DOWNLOADED_TASKS, "rows": rows, "wall_s": round(time.time() - started, 1),
        "lm_eval_command_example": shlex.join(shown),
        "command": shlex.join(["python", "bench/ruler.py", *argv_shown]),
        "table_markdown": table,
    }
    (out / f"{tag}.json").write_text(json.dumps(record, indent=2))
    (out / f"{tag}.md").write_text(
        f"# RULER through the server, {date}\n\n{record['what']}; lm-eval {lm_eval_version}, {args.limit} samples "
        f"per task and length; model `{key['model']}`, gate `{record['gate']}`; commit {record['commit']}.\n\n"
        f"{table}\n\nCommand: `{record['command']}`\n")
    partial.unlink(missing_ok=True)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
