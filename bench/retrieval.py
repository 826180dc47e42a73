"""RULER-kind retrieval at long context, per selector and budget, from ONE dense prefill per haystack.

    .venv/bin/python bench/retrieval.py --model models/Qwen2.5-Coder-0.5B-Instruct \\
        --gate gate_checkpoints/qwen2.5-coder-0.5b-instruct-sas --lengths 16384 --haystacks 4 \\
        --configs dense oracle gate gate@a4 quest exactmax pairs4 gatesub16 --budgets 2048 1024 \\
        --out bench/results/DATE-retrieval/qwen-16k.json

Each haystack (`sas_backend.hf.retrieval_tasks`: out-of-domain prose, @handbook by default, with 20 facts'
worth of questions: single needle, multi-key, multi-value, variable tracking, 5 each) is prefilled densely
once; its KV cache is kept on disk (--cache-dir), so a rerun or a new selector costs no prefill. Every
question then runs from that cached prefix as the server would serve it: the question and the answer prefix
dense (prefill), the reply's tokens sparse decode queries under each config. Per (question, config):
- `nll`: the teacher-forced NLL of the gold reply (its first token comes from the dense prefill, the rest
  from sparse queries), and its excess over dense's;
- `score`: RULER's score of the greedy reply (share of the answers written; up to --max-new tokens).

A config is a selector (`hf.sparse_eval.eval_selectors()` or a candidate of `hf.candidates`), optionally `@aR`:
R prompt anchors (the blocks the prompt's last token attended most, forced inside K, as
`--sas-prompt-anchors R`). Every sparse config uses the same forced blocks (--sink / --local, default the
Qwen gate's serve default 1 / 1) and budget rule. `pairs<R>` and `pca<R>` are calibrated once on --calib-tokens
of @essays (the gates' training text, never a haystack). The record is rewritten after every question, and a rerun
with the same --out resumes (rows already there are kept, the key must match).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import pathlib
import shlex
import sys
import time
from typing import Dict, List

import torch

REPO = pathlib.Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from sas_backend.hf.retrieval_tasks import TASKS, make_haystack, prompt_parts, score_reply, shared_prefix_ids  # noqa
from sas_backend.provenance import git_state, portable_argv, portable_path  # noqa: E402

MAX_NEW = {"single": 12, "multikey": 12, "multivalue": 48, "vt": 40}
PREFILL_CHUNK = 2048


def parse_config(config: str):
    """(selector, anchors) of a config label `NAME` or `NAME@aR`."""
    name, _, extra = config.partition("@")
    anchors = 0
    if extra:
        if not (extra.startswith("a") and extra[1:].isdigit()):
            raise ValueError(f"config {config!r}: the suffix must be @a<anchors>")
        anchors = int(extra[1:])
    return name, anchors


def filler_text(source: str, tok) -> str:
    """The filler prose of `source` (a named corpus, e.g. @handbook), documents in name order."""
    from sas_backend.training.data import read_documents

    docs = read_documents([source], tokenizer=tok)
    return "\n\n".join(d.text for d in sorted(docs, key=lambda d: d.name))


@torch.no_grad()
def dense_prefix(model, ids: List[int], path: pathlib.Path):
    """The dense transformers cache of `ids`, from `path` when an earlier run saved it there (checked against
    the ids' sha256), else prefilled in chunks and saved."""
    from transformers import DynamicCache

    digest = hashlib.sha256(json.dumps(ids).encode()).hexdigest()
    cache = DynamicCache(config=model.config)
    if path.exists():
        saved = torch.load(path, weights_only=True)
        if saved["ids_sha256"] == digest:
            for layer, (k, v) in enumerate(saved["kv"]):
                cache.update(k, v, layer)
            return cache
    t0 = time.time()
    x = torch.tensor(ids)[None]
    for s in range(0, len(ids), PREFILL_CHUNK):
        model(x[:, s:s + PREFILL_CHUNK], past_key_values=cache, use_cache=True, logits_to_keep=1)
        print(f"[retrieval]   prefill {min(s + PREFILL_CHUNK, len(ids))}/{len(ids)} ({time.time() - t0:.0f} s)",
              flush=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({"ids_sha256": digest, "kv": [(lay.keys, lay.values) for lay in cache.layers]}, tmp)
    os.replace(tmp, path)
    return cache


@torch.no_grad()
def answer_run(model, cache, n_prompt: int, last_logits, gold: List[int], spec, max_new: int, tok, stop_ids,
               answers=()):
    """(teacher-forced NLL of `gold`, greedy reply text) from the prompt's cache (`n_prompt` tokens, left as
    given); `last_logits` `[V]` the prompt's last position (dense prefill) predicts the first token; `spec`
    (SparseEvalSpec, or None for dense) governs every later query. Greedy decoding stops at a stop token,
    after `max_new` tokens, or once the reply holds every one of `answers` and a token past the last."""
    import contextlib

    from sas_backend.hf.sparse_eval import sparse_eval

    def ctx():
        return contextlib.nullcontext() if spec is None else sparse_eval(model, spec, max_pos=n_prompt + 64 + max(
            len(gold), max_new))

    nll = float(torch.nn.functional.cross_entropy(last_logits[None].float(), torch.tensor(gold[:1])))
    try:
        if len(gold) > 1:
            with ctx():
                logits = model(torch.tensor(gold[:-1])[None], past_key_values=cache, use_cache=True).logits[0]
            nll += float(torch.nn.functional.cross_entropy(logits.float(), torch.tensor(gold[1:]), reduction="sum"))
        cache.crop(n_prompt)
        out = [int(last_logits.argmax())]
        with ctx():
            while len(out) < max_new and out[-1] not in stop_ids:
                if answers and all(a in tok.decode(out[:-1]) for a in answers):
                    break
                logits = model(torch.tensor(out[-1:])[None], past_key_values=cache, use_cache=True).logits[0, -1]
                out.append(int(logits.argmax()))
    finally:
        cache.crop(n_prompt)
    return nll, tok.decode([t for t in out if t not in stop_ids])


def mean_se(xs: List[float]):
    """(mean, standard error) of `xs` (SE 0 for fewer than two)."""
    n = len(xs)
    if not n:
        return float("nan"), float("nan")
    m = sum(xs) / n
    if n < 2:
        return m, 0.0
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1) / n)


def summary(rows: List[dict]) -> Dict[str, dict]:
    """Per (config label, task): n, mean score (x100) and SE, mean score difference to dense paired by question
    and its SE, mean excess NLL over dense and its SE."""
    dense = {(r["length"], r["seed"], r["qid"]): r for r in rows if r["config"] == "dense"}
    out: Dict[str, dict] = {}
    for label in dict.fromkeys(r["label"] for r in rows):
        per = {}
        for task in TASKS:
            sel = [r for r in rows if r["label"] == label and r["task"] == task]
            pairs = [(r, dense[(r["length"], r["seed"], r["qid"])]) for r in sel
                     if (r["length"], r["seed"], r["qid"]) in dense]
            score, score_se = mean_se([100 * r["score"] for r in sel])
            diff, diff_se = mean_se([100 * (r["score"] - d["score"]) for r, d in pairs])
            dnll, dnll_se = mean_se([r["nll"] - d["nll"] for r, d in pairs])
            per[task] = {"n": len(sel), "score": score, "score_se": score_se, "vs_dense": diff,
                         "vs_dense_se": diff_se, "excess_nll": dnll, "excess_nll_se": dnll_se}
        out[label] = per
    return out


def markdown(rows: List[dict]) -> str:
    """The record's table: per config, each task's score (x100, +- SE over its questions, n), the mean over the
    tasks asked, the task furthest below dense (paired by question) and the mean excess NLL of the gold reply."""
    s = summary(rows)
    tasks = [t for t in TASKS if any(r["task"] == t for r in rows)]
    lines = ["| config | " + " | ".join(tasks) + " | mean | worst task vs dense | excess NLL over dense (nats) |",
             "|---" * (len(tasks) + 4) + "|"]
    for label, per in s.items():
        asked = [t for t in tasks if per[t]["n"]]  # a config run on fewer haystacks may miss a task
        cells = [f"{per[t]['score']:.0f} +- {per[t]['score_se']:.0f} (n={per[t]['n']})" if per[t]["n"] else "-"
                 for t in tasks]
        mean = f"{sum(per[t]['score'] for t in tasks) / len(tasks):.1f}" if len(asked) == len(tasks) else "-"
        worst = min((per[t]["vs_dense"] for t in asked), default=float("nan"))
        n_all = sum(per[t]["n"] for t in asked)
        dn = sum(per[t]["excess_nll"] * per[t]["n"] for t in asked) / max(n_all, 1)
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {mean} | {worst:+.0f} | {dn:+.2f} |")
    return "\n".join(lines)


def read_rows(paths) -> List[dict]:
    """The rows of several records of one study (the same key: model, gate, filler, forced blocks), e.g. haystack
    seeds run side by side into separate files; a (haystack, question, config) measured twice is refused."""
    rows, key, seen = [], None, set()
    for p in paths:
        rec = json.loads(pathlib.Path(p).read_text())
        if key is not None and rec["key"] != key:
            raise ValueError(f"{p} was measured with {rec['key']}, not {key}")
        key = rec["key"]
        for r in rec["rows"]:
            ident = (r["length"], r["seed"], r["qid"], r["label"])
            if ident in seen:
                raise ValueError(f"{p}: {ident} is in two records")
            seen.add(ident)
            rows.append(r)
    return rows


def write_record(path: pathlib.Path, record: dict) -> None:
    """The record rewritten whole (atomically), one row a line (compact: every committed byte travels in each GPU
    device call), and its table beside it."""
    head = {k: v for k, v in record.items() if k != "rows"}
    rows = ",\n".join(json.dumps(r, separators=(",", ":")) for r in record["rows"])
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(head, separators=(",", ":"))[:-1] + ',"rows":[\n' + rows + "\n]}\n")
    os.replace(tmp, path)
    path.with_suffix(".md").write_text(markdown(record["rows"]) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--gate", default=None, help="gate checkpoint (for the gate, gatesub<S>, gatec<X>exact and "
                    "gatesub<S>c<X>exact configs: the last two the server's --sas-exact-rerank X, with "
                    "--sas-sub-blocks 64 / S)")
    ap.add_argument("--lengths", type=int, nargs="+", default=[16384], help="haystack tokens")
    ap.add_argument("--haystacks", type=int, default=4, help="haystacks per length (seeds 0..N-1)")
    ap.add_argument("--seeds", type=int, nargs="+", default=None,
                    help="only these haystack seeds (default: 0..--haystacks - 1); runs on other seeds can go to other "
                         "--out files side by side, their rows read together (`read_rows`)")
    ap.add_argument("--configs", nargs="+", default=["dense", "oracle", "gate", "gate@a4", "quest", "exactmax",
                                                      "pairs4", "gatesub16"])
    ap.add_argument("--budgets", type=int, nargs="+", default=[2048])
    ap.add_argument("--sink", type=int, default=1)
    ap.add_argument("--local", type=int, default=1)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--filler", default="@handbook", help="the haystacks' prose (a named corpus)")
    ap.add_argument("--calib-tokens", type=int, default=4096, help="@essays tokens that calibrate pairs<R> and pca<R>")
    ap.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    ap.add_argument("--cache-dir", default=str(REPO / "build" / "retrieval-cache"))
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--out", required=True, help="the record (.json; a .md table beside it)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sas_backend.hf.candidates import is_candidate
    from sas_backend.hf.sparse_eval import SparseEvalSpec, eval_selectors, prompt_anchors
    from sas_backend.training.eval_ppl import calibrate_candidates, load_gates

    configs = [(c, *parse_config(c)) for c in args.configs]
    for c, name, _ in configs:
        if name not in eval_selectors() and not is_candidate(name):
            raise SystemExit(f"error: config {c!r}: unknown selector {name!r}")
    if "dense" not in [name for _, name, _ in configs]:
        configs.insert(0, ("dense", "dense", 0))
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    gates, gate_sha = None, None
    if args.gate:
        from sas_backend.gate.gate_file import weights_sha256

        gates, _ = load_gates(args.gate, model, args.block_size, torch.device("cpu"))
        gate_sha = weights_sha256(args.gate)
    key = {"model": portable_path(args.model), "gate": portable_path(args.gate) if args.gate else None,
           "gate_weights_sha256": gate_sha, "filler": args.filler, "sink": args.sink, "local": args.local,
           "block_size": args.block_size, "calib_tokens": args.calib_tokens}
    record = {"key": key, "command": shlex.join(["python", "bench/retrieval.py", *portable_argv(sys.argv[1:])]),
              "started": git_state(), "rows": []}
    if out.exists():
        old = json.loads(out.read_text())
        if old["key"] != key:
            raise SystemExit(f"error: {out} was written with {old['key']}, not {key}: another --out")
        record["rows"] = old["rows"]
        record.setdefault("runs", old.get("runs", [old["started"]]))
        record["runs"].append(git_state())
        print(f"[retrieval] resuming {out}: {len(record['rows'])} rows", flush=True)
    done = {(r["length"], r["seed"], r["qid"], r["label"]) for r in record["rows"]}

    # config name -> its calibrated index (`SparseEvalSpec.index`): pairs<R> / pca<R>[mass], as eval_ppl calibrates
    index = calibrate_candidates(model, tok, [name for _, name, _ in configs], args.calib_tokens)
    filler = filler_text(args.filler, tok)
    stop_ids = {tok.eos_token_id, *tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])} - {None}
    t_start = time.time()
    for length in args.lengths:
        for seed in (args.seeds if args.seeds is not None else range(args.haystacks)):
            hay = make_haystack(tok, filler, length, seed)
            questions = [q for q in hay.questions if q.task in args.tasks]
            parts = [prompt_parts(tok, hay, q) for q in questions]
            gold = [tok(q.gold, add_special_tokens=False)["input_ids"] for q in questions]
            prefix, suffixes = shared_prefix_ids(tok, parts[0][0], [p[1] for p in parts])
            labels = [run[0] for run in _runs(configs, args.budgets)]
            todo = [i for i in range(len(questions)) if any((length, seed, i, lab) not in done for lab in labels)]
            if not todo:
                continue
            print(f"[retrieval] L={length} haystack {seed}: {len(prefix)} prefix tokens, {len(todo)} questions "
                  f"to ask ({time.time() - t_start:.0f} s)", flush=True)
            cache = dense_prefix(model, prefix, pathlib.Path(args.cache_dir) / f"{_model_tag(args.model)}-"
                                 f"{args.filler.strip('@')}-L{length}-s{seed}.pt")
            for i in todo:
                q = questions[i]
                cache.crop(len(prefix))
                prompt = prefix + suffixes[i]
                last = model(torch.tensor(suffixes[i])[None], past_key_values=cache, use_cache=True,
                             logits_to_keep=1).logits[0, -1]
                n_prompt = len(prompt)
                anchors_of: Dict[int, dict] = {}
                for label, config, name, n_anchor, budget in _runs(configs, args.budgets):
                    if (length, seed, i, label) in done:
                        continue
                    spec = None
                    if name != "dense":
                        if n_anchor and n_anchor not in anchors_of:
                            anchors_of[n_anchor] = prompt_anchors(model, prompt, cache, n_anchor,
                                                                  block_size=args.block_size)
                        spec = SparseEvalSpec(top_k=budget // args.block_size, block_size=args.block_size,
                                              selector=name, gates=gates, sink_blocks=args.sink,
                                              local_blocks=args.local, sparse_from=n_prompt,
                                              anchors=anchors_of.get(n_anchor) if n_anchor else None,
                                              index=index.get(name))
                    t0 = time.time()
                    nll, reply = answer_run(model, cache, n_prompt, last, gold[i], spec, MAX_NEW[q.task], tok,
                                            stop_ids, q.answers)
                    row = {"length": length, "seed": seed, "qid": i, "task": q.task, "label": label,
                           "config": config, "budget": budget,
                           "anchors": n_anchor, "prompt_tokens": n_prompt, "nll": nll, "reply": reply,
                           "answers": list(q.answers), "score": score_reply(q, reply),
                           "seconds": round(time.time() - t0, 2)}
                    record["rows"].append(row)
                    done.add((length, seed, i, label))
                print(f"[retrieval]   q{i} {q.task}: " + ", ".join(
                    f"{r['label']} {r['score']:.2f}" for r in record["rows"]
                    if (r["length"], r["seed"], r["qid"]) == (length, seed, i)) +
                    f" ({time.time() - t_start:.0f} s)", flush=True)
                write_record(out, record)
            cache.crop(0)
            del cache
    write_record(out, record)
    print(markdown(record["rows"]))
    return 0


def _model_tag(model: str) -> str:
    return pathlib.Path(model).name


def _runs(configs, budgets):
    """(label, config, selector, anchors, budget) of every run: dense once, each sparse config at each budget."""
    for c, name, n_anchor in configs:
        if name == "dense":
            yield "dense", c, name, 0, 0
        else:
            for b in budgets:
                yield f"{c}/b{b}", c, name, n_anchor, b


if __name__ == "__main__":
    sys.exit(main())
