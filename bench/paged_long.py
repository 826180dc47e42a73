"""The paged-summary path at long context, through real servers: each case equals its flushed or solo run.

    .venv/bin/python bench/paged_long.py --model models/Qwen2.5-Coder-0.5B-Instruct    # 32K, ~1.5 h on 2 cores
    .venv/bin/python bench/paged_long.py --quick                                      # default model at 3K, ~3 min

The sas backend keeps one summary row per complete KV page (the gate's block key) and scores them at
decode. Three ways a long request reaches decode with pages it did not write in one go:

1. radix: a warm request leaves `--prefix` tokens in the radix cache; the query (`--context` tokens,
   the same prefix, another tail) reuses those pages and their summary rows (cached_tokens says so).
   Equal to the same query after /flush_cache.
2. chunked: the query prefilled in chunks of `--chunk` tokens, its last chunk ending mid-page (a
   page's summary row is written by the extend that completes the page, or by the decode step that
   does). SGLang requires the chunk size to be a multiple of the page ("chunked_prefill_size must be
   divisible by page_size") and its scheduler ends every chunk but a request's last on a page boundary
   (0.5.21, `managers/schedule_policy.py`, outside gfx95's exact-chunk mode), so mid-page chunk ends
   come from prompt lengths: the query and the pressure prompts are not multiples of the page, and a
   retracted request resumes with a prefill of its prompt and its tokens so far. Equal to the query on
   the reference server (chunks of `--reference-chunk`).
3. pressure: two prompts decoding `--pressure-tokens` each at once in server B's pool, sized so that
   SGLang admits both (it admits a request when its prompt plus its whole max_tokens fit beside the
   running ones' prompts and a share of their remaining max_tokens) but their outputs outgrow the pool:
   the scheduler retracts one (its pages freed) and resumes it later (prefilled again, prompt and
   tokens so far). Each equal to its solo run on a flushed cache. Both decode all their tokens
   (`min_tokens`: an early end of text would free the pool; `ignore_eos` would make SGLang reserve the
   whole max_tokens at admission, so the two would never be admitted together).

Equal: the same greedy tokens, and token logprobs within `--tol` (reported). Servers (one at a time):
A, the reference (default chunk, large pool): the radix case, the flushed query, the solo runs; B (`--chunk`,
the small pool): the chunked and pressure cases. fp32, page 64, the model's default gate
(serve/default_gate.py) at `--budget` (sparse: the contexts are many budgets long). After each case
the server goes idle with every page back (/sas/info). A killed run keeps its finished steps in
<out>/paged-long-<model>-<context>.partial.json; `--resume` that file to skip them.

Writes <out>/paged-long-<model>-<context>.{json,md}.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import pathlib
import re
import shlex
import sys
import time

from sas_backend.corpus import read_essays
from sas_backend.provenance import git_state, portable_argv, repo_relative
from sas_backend.testing.server import DEFAULT_MODEL, Server, default_gate
from sas_backend.soak.run import flush_cache, greedy, scan_log, wait_idle

REPO = pathlib.Path(__file__).resolve().parent.parent
PAGE = 64


def essay_ids(model: str) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    tok.model_max_length = 1 << 30
    essays = read_essays()
    return tok("\n\n".join(essays[k] for k in sorted(essays)))["input_ids"]


def compare(run: dict, ref: dict, tol: float) -> dict:
    """Greedy tokens equal and logprobs within tol."""
    same = run["token_ids"] == ref["token_ids"]
    diff = max((abs(a - b) for a, b in zip(run["logprobs"], ref["logprobs"])), default=0.0)
    return {"tokens_equal": same, "max_abs_logprob_diff": diff, "equal": same and diff <= tol}


PREFILL_RE = re.compile(r"Prefill batch, #new-seq: 1, #new-token: (\d+), #cached-token: (\d+),.*?#pending-token: (\d+)")


def resumed_lengths(log_text: str, prompt_len: int) -> list[int]:
    """Output tokens each retracted request had when it resumed, from SGLang's log: a resumed request's
    first prefill line covers its prompt and its tokens so far (cached + new + pending tokens), more
    than any of these equal-length prompts alone. One entry per resume, in log order."""
    after = log_text.split("Retract requests", 1)
    if len(after) < 2:
        return []
    out, pending = [], None
    for m in PREFILL_RE.finditer(after[1]):
        new, cached, left = (int(x) for x in m.groups())
        continues = pending is not None and new + left == pending  # the next chunk of the same prefill
        pending = left
        if not continues and new + cached + left > prompt_len:
            out.append(new + cached + left - prompt_len)
    return out


def idle_state(url: str) -> dict:
    """After a case: every request gone, every page free once the cache is flushed."""
    idle = wait_idle(url)
    flush_cache(url)
    flushed = wait_idle(url)
    pages = flushed.get("kv_pages", {})
    return {"idle": bool(idle.get("idle")), "pages_free_after_flush": pages.get("free") == pages.get("total"),
            "kv_pages": pages, "summary_rows": flushed.get("summary_rows")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--gate", default=None,
                    help="gate checkpoint (default: the one serve/serve.sh serves the model with)")
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--context", type=int, default=32040, help="query tokens (radix and chunked cases; not a "
                    "multiple of 64, so the last chunk ends mid-page)")
    ap.add_argument("--prefix", type=int, default=16384, help="radix-shared prefix tokens")
    ap.add_argument("--chunk", type=int, default=1984, help="server B's --chunked-prefill-size (a multiple of 64)")
    ap.add_argument("--reference-chunk", type=int, default=8192, help="server A's --chunked-prefill-size")
    ap.add_argument("--new-tokens", type=int, default=16, help="greedy tokens of the radix and chunked cases")
    ap.add_argument("--pressure-tokens", type=int, default=1500, help="greedy tokens of each pressure request")
    ap.add_argument("--tol", type=float, default=2e-3, help="largest logprob difference that counts as equal")
    ap.add_argument("--quick", action="store_true", help="rehearsal: the default model at 3K tokens; not a result")
    ap.add_argument("--resume", default=None, metavar="PARTIAL_JSON")
    ap.add_argument("--out", default=str(REPO / "bench" / "results"))
    args = ap.parse_args(argv)
    if args.quick:
        args.budget, args.context, args.prefix = 512, 3000, 1536
        args.chunk, args.reference_chunk, args.new_tokens = 320, 2048, 8
        args.pressure_tokens = 600
    if args.chunk % PAGE or args.reference_chunk % PAGE:
        ap.error(f"--chunk and --reference-chunk must be multiples of the {PAGE}-token page (SGLang requires it)")
    if args.context % PAGE == 0:
        ap.error(f"--context {args.context} is a multiple of {PAGE}: "
                 "the query's last chunk would end on a page boundary")
    pool = args.context + args.new_tokens + 4 * PAGE  # server B: the chunked query fits, the pressure outputs do not
    # Two prompts of lp tokens: admitted together while 2 lp + lt (the second's whole max_tokens) + ~0.7 lt
    # (the first's reserve) + a page fit the pool; pressed once 2 (lp + lt) does not.
    n, lt = 2, args.pressure_tokens
    lp = int((pool - 1.85 * lt) / 2)
    lp -= 1 if lp % PAGE == 0 else 0  # resumed prefills then end mid-page too
    if lp < 4 * PAGE or 2 * (lp + lt) <= pool:
        ap.error(f"--pressure-tokens {lt} does not press a {pool}-token pool")
    args.gate = str(args.gate or default_gate(args.model))

    ids = essay_ids(args.model)
    need = args.context + (args.context - args.prefix) + 2 * PAGE + n * lp
    if len(ids) < need:
        sys.exit(f"the essays hold {len(ids)} tokens, fewer than the {need} these sizes need")
    prefix = ids[:args.prefix]
    warm = prefix + ids[args.context:args.context + 2 * PAGE]  # leaves the prefix's pages in the radix cache
    at = args.context + 2 * PAGE
    query = prefix + ids[at:at + args.context - args.prefix]
    at += args.context - args.prefix
    pressure = [ids[at + i * lp: at + (i + 1) * lp] for i in range(n)]

    name = f"paged-long-{pathlib.Path(args.model).name}-{args.context}" + ("-quick" if args.quick else "")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    partial = out / f"{name}.partial.json"
    sizes = {**{k: getattr(args, k) for k in ("budget", "context", "prefix", "chunk", "reference_chunk", "new_tokens",
                                               "pressure_tokens")}, "pressure_prompts": [lp] * n, "pool_b": pool}
    state = {"sizes": sizes, "steps": {}}
    if args.resume:
        state = json.loads(pathlib.Path(args.resume).read_text())
        if state["sizes"] != sizes:
            sys.exit(f"{args.resume} was made with other sizes ({state['sizes']}); not resuming")
    steps = state["steps"]

    def save():
        partial.write_text(json.dumps(state))

    common = ["--dtype", "float32", "--page-size", str(PAGE), "--enable-cache-report",
              "--context-length", str(max(args.context + args.new_tokens, lp + lt) + PAGE),
              "--sas-gate", args.gate, "--sas-budget", str(args.budget)]
    # A's pool holds the query and, separately, each solo run (the harness's CPU default is 16384 tokens)
    a_flags = common + ["--max-total-tokens", str(max(16384, pool, lp + lt + 4 * PAGE)),
                        "--chunked-prefill-size", str(args.reference_chunk)]
    started = time.time()

    def log(msg):
        print(f"[paged-long {time.time() - started:6.0f} s] {msg}", flush=True)

    if not {"radix", "solo"} <= set(steps):
        log(f"server A (reference): {' '.join(a_flags)}")
        with Server(args.model, backend="sas", extra_args=a_flags) as a:
            if "radix" not in steps:
                flush_cache(a.url)
                log(f"warm: {len(warm)} tokens")
                greedy(a.url, warm, 1)
                log(f"query on the cached {args.prefix}-token prefix: {len(query)} tokens")
                cached = greedy(a.url, query, args.new_tokens)
                flush_cache(a.url)
                log("the same query on a flushed cache")
                fresh = greedy(a.url, query, args.new_tokens)
                steps["radix"] = {"cached": cached, "fresh": fresh, "cached_tokens": cached["cached_tokens"],
                                  "cached_tokens_fresh": fresh["cached_tokens"],
                                  "expected_cached": args.prefix // PAGE * PAGE, **compare(cached, fresh, args.tol),
                                  "after": idle_state(a.url)}
                save()
                log(f"radix: {json.dumps({k: v for k, v in steps['radix'].items() if k not in ('cached', 'fresh')})}")
            if "solo" not in steps:
                solo = []
                for i, p in enumerate(pressure):
                    flush_cache(a.url)
                    log(f"solo {i}: {len(p)} tokens, {lt} new")
                    solo.append(greedy(a.url, p, lt, min_tokens=lt))
                steps["solo"] = {"runs": solo, "after": idle_state(a.url)}
                save()
            steps["server_a_log"] = scan_log(a.log_text())
            save()

    b_flags = common + ["--chunked-prefill-size", str(args.chunk), "--max-total-tokens", str(pool),
                        "--schedule-conservativeness", "0.05"]
    if not {"chunked", "pressure"} <= set(steps):
        log(f"server B: {' '.join(b_flags)}")
        with Server(args.model, backend="sas", extra_args=b_flags) as b:
            if "chunked" not in steps:
                flush_cache(b.url)
                log(f"chunked: {len(query)} tokens in chunks of {args.chunk}")
                run = greedy(b.url, query, args.new_tokens)
                steps["chunked"] = {"run": run, **compare(run, steps["radix"]["fresh"], args.tol),
                                    "chunks": -(-len(query) // args.chunk),
                                    "reference_chunks": -(-len(query) // args.reference_chunk),
                                    "last_chunk_ends_mid_page": len(query) % PAGE != 0,
                                    "after": idle_state(b.url)}
                save()
                log(f"chunked: equal {steps['chunked']['equal']}, max |dlogprob| "
                    f"{steps['chunked']['max_abs_logprob_diff']:.2e}")
            if "pressure" not in steps:
                flush_cache(b.url)
                log_at = len(b.log_text())
                log(f"pressure: {n} x {lp} tokens, {lt} new each, pool {pool}")
                with concurrent.futures.ThreadPoolExecutor(n) as ex:
                    runs = list(ex.map(lambda p: greedy(b.url, p, lt, timeout=7200, min_tokens=lt), pressure))
                pressed_log = b.log_text()[log_at:]
                retracted = scan_log(pressed_log)["retracted_requests"]
                resumes = resumed_lengths(pressed_log, lp)
                per = []
                for prompt, run, solo in zip(pressure, runs, steps["solo"]["runs"]):
                    whole = compare(run, solo, args.tol)
                    if whole["equal"] or len(resumes) != 1:
                        per.append({**whole, "resumed_at": None})
                        continue
                    # The retracted one: before the retraction equal to its solo run; after it, equal to a
                    # fresh request whose prompt is its prompt and its first k tokens (what the resume prefilled)
                    k = resumes[0]
                    flush_cache(b.url)
                    log(f"pressure: the retracted request resumed after {k} tokens; its reference: "
                        f"{lp + k} tokens prefilled, {lt - k} decoded")
                    ref = greedy(b.url, list(prompt) + run["token_ids"][:k], lt - k, timeout=7200, min_tokens=lt - k)
                    head = compare({k2: v[:k] for k2, v in run.items() if k2 != "cached_tokens"},
                                   {k2: v[:k] for k2, v in solo.items() if k2 != "cached_tokens"}, args.tol)
                    tail = compare({k2: v[k:] for k2, v in run.items() if k2 != "cached_tokens"}, ref, args.tol)
                    per.append({**whole, "resumed_at": k, "before_resume": head, "after_resume": tail,
                                "equal": head["equal"] and tail["equal"]})
                steps["pressure"] = {"runs": runs, "per_request": per, "retracted_requests": retracted,
                                     "resumed_at": resumes, "equal": all(p["equal"] for p in per),
                                     "after": idle_state(b.url)}
                save()
                log(f"pressure: retracted {retracted}, resumed at {resumes}, equal {[p['equal'] for p in per]}")
            steps["server_b_log"] = scan_log(b.log_text())
            save()

    checks = {
        "radix: prefix served from the cache": steps["radix"]["cached_tokens"] >= steps["radix"]["expected_cached"],
        "radix: equal to the flushed run": steps["radix"]["equal"],
        "chunked: more chunks than the reference, the last ending mid-page":
            steps["chunked"]["last_chunk_ends_mid_page"]
            and steps["chunked"]["chunks"] > steps["chunked"]["reference_chunks"],
        "chunked: equal to the reference chunking": steps["chunked"]["equal"],
        "pressure: requests were retracted": steps["pressure"]["retracted_requests"] > 0,
        "pressure: every request decoded all its tokens":
            all(len(r["token_ids"]) == lt for r in steps["pressure"]["runs"]),
        "pressure: each equal to its solo run (a resumed one: before it, and after it to its prompt + tokens so far "
        "prefilled)": steps["pressure"]["equal"],
        "every case: idle after, every page free after a flush": all(
            steps[k]["after"]["idle"] and steps[k]["after"]["pages_free_after_flush"]
            for k in ("radix", "solo", "chunked", "pressure")),
        "no traceback in either server's log": steps["server_a_log"]["tracebacks"] == 0
        and steps["server_b_log"]["tracebacks"] == 0,
    }
    lines = ["| check | result |", "|---|---|"] + [f"| {k} | {'yes' if v else 'NO'} |" for k, v in checks.items()]
    r, c, p = steps["radix"], steps["chunked"], steps["pressure"]
    detail = (f"radix: {r['cached_tokens']} of {len(query)} prompt tokens from the cache, max |dlogprob| "
              f"{r['max_abs_logprob_diff']:.2e}; chunked: {c['chunks']} chunks (reference {c['reference_chunks']}), "
              f"max |dlogprob| {c['max_abs_logprob_diff']:.2e}; pressure: {p['retracted_requests']} "
              f"retracted, resumed after {p['resumed_at']} tokens; per request max |dlogprob| vs its solo run "
              + ", ".join(f"{x['max_abs_logprob_diff']:.2e}" + (
                  f" (before the resume {x['before_resume']['max_abs_logprob_diff']:.2e}, after it vs its prompt + "
                  f"tokens so far prefilled {x['after_resume']['max_abs_logprob_diff']:.2e})"
                  if x.get("resumed_at") else "")
                  for x in p["per_request"]))
    record = {
        "what": "the paged-summary path at long context: radix, chunked prefill mid-page, pool pressure",
        "rehearsal": args.quick, "date": datetime.date.today().isoformat(), "git": git_state(),
        "command": " ".join(shlex.quote(a) for a in ["python", "bench/paged_long.py",
                                                     *(sys.argv[1:] if argv is None else argv)]),
        "model": repo_relative(args.model), "gate": repo_relative(args.gate), "sizes": sizes, "tol": args.tol,
        "server_a_flags": portable_argv(a_flags), "server_b_flags": portable_argv(b_flags), "checks": checks,
        "detail": detail,
        "steps": {k: ({kk: vv for kk, vv in v.items() if kk not in ("runs", "cached", "fresh", "run")}
                      if isinstance(v, dict) else v) for k, v in steps.items()},
        "wall_s_this_run": round(time.time() - started, 1),
    }
    (out / f"{name}.json").write_text(json.dumps(record, indent=2))
    (out / f"{name}.md").write_text(f"# {record['what']}, {record['date']}\n\n    {record['command']}\n\n"
                                    + "\n".join(lines) + f"\n\n{detail}\n")
    partial.unlink(missing_ok=True)
    print("\n".join(lines))
    print(detail)
    print(f"[paged-long] wrote {out / (name + '.json')} and {out / (name + '.md')}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
