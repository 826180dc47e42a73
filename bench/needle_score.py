"""Needle, teacher-forced: how sure is each selector of the passphrase? The continuous companion of needle.py.

    .venv/bin/python bench/needle_score.py --budgets 2048 --gate-forced 1,1 --tag shipped

needle.py asks the real server and counts a depth as recalled when the greedy answer holds the passphrase:
one bit per depth, and with a 135M model the dense answer itself is often a near tie (at two of its five
depths the passphrase's first token has probability ~0.1 under dense attention), so a harmless change of a
selector can flip a depth either way. Here the same prompts (bench/needle.py's haystack and question, the
model's chat template with the generation prompt, as the server renders them) are followed by the expected
answer (the needle sentence) and run through transformers with SAS sparse attention under the serving rule:
the prompt dense (as after prefill), the answer's tokens sparse queries (what decode attends). Reported per
selector and depth: the NLL of the passphrase's tokens (summed) and whether its first token is the argmax;
in the JSON also, per layer, the share of the answer's (query, kv head) pairs that chose the passphrase's block.
A selector that misses the fact's block shows it as an NLL far above dense's, whatever greedy decoding does.

Writes bench/results/needle-score-<date>[-TAG].{json,md}.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import pathlib
import shlex
import sys
import time

import torch

from needle import CODES, NEEDLE, PLACES, QUESTION, haystack_with_needle  # noqa: E402

from sas_backend.corpus import read_essays  # noqa: E402
from sas_backend.provenance import git_state, repo_relative  # noqa: E402
from sas_backend.testing.server import DEFAULT_MODEL, default_gate  # noqa: E402
from sas_backend.training.eval_ppl import BASELINES, load_gates, parse_forced, parse_gates  # noqa: E402


ANSWERS = ("sentence", "passphrase")


def needle_cases(tok, context: int, depths, answer: str = "sentence"):
    """[(depth, prompt ids, answer ids, passphrase slice in the answer)] for bench/needle.py's facts.
    answer: "sentence" (the needle sentence; its passphrase tokens are all sparse queries' predictions) or
    "passphrase" (the passphrase alone, as the question asks and the server answers: its first token comes from
    the prompt's last position, i.e. dense prefill, the rest from sparse decode)."""
    if answer not in ANSWERS:
        raise ValueError(f"answer must be one of {ANSWERS}, got {answer!r}")
    essays = read_essays()
    text = "\n\n".join(essays[k] for k in sorted(essays))
    cases = []
    for i, depth in enumerate(depths):
        place, code = PLACES[i % len(PLACES)], CODES[i % len(CODES)]
        hay = haystack_with_needle(tok, text, context, depth, NEEDLE.format(place=place, code=code))
        prompt = tok.apply_chat_template([{"role": "user", "content": hay + "\n\n" + QUESTION.format(place=place)}],
                                         tokenize=False, add_generation_prompt=True)
        p_ids = tok(prompt, add_special_tokens=False)["input_ids"]
        if answer == "passphrase":
            a_ids = tok(code, add_special_tokens=False)["input_ids"]
            start, end = 0, len(a_ids)
        else:
            head = NEEDLE.format(place=place, code="").rstrip(".").rstrip()
            a_ids = tok(NEEDLE.format(place=place, code=code), add_special_tokens=False)["input_ids"]
            start = len(tok(head, add_special_tokens=False)["input_ids"])
            end = len(a_ids) - 1  # the final "."
        if tok.decode(a_ids[start:end]).strip() != code:
            raise ValueError(f"passphrase {code!r} is not tokens [{start}:{end}] of the answer")
        cases.append((depth, p_ids, a_ids, slice(start, end)))
    return cases


def fact_block(p_ids, a_ids, code: slice, block_size: int):
    """The block of the prompt that holds the passphrase (its first token), or None if not found."""
    want = a_ids[code]
    hits = [j for j in range(len(p_ids) - len(want) + 1) if p_ids[j:j + len(want)] == want]
    return hits[0] // block_size if hits else None


@torch.no_grad()
def prefill(model, p_ids):
    """The prompt run densely once (as the server's prefill): (its KV cache, `[V]` logits of its last position).
    passphrase_nll(prefilled=...) reuses it for every selector, so a long prompt is not recomputed per config,
    and only the last position's logits are kept (a 16K prompt's full logits would be ~10 GB)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    out = model(torch.tensor(p_ids)[None], past_key_values=cache, use_cache=True, logits_to_keep=1)
    return cache, out.logits[0, -1]


@torch.no_grad()
def passphrase_nll(model, p_ids, a_ids, code: slice, spec=None, selected=None, prefilled=None):
    """(summed NLL of the passphrase tokens, its first token is the argmax, every one of its tokens is the argmax)
    for the prompt followed by the answer (the last: greedy decoding would write the passphrase); `spec`
    (SparseEvalSpec, sparse_from = len(prompt)) makes the answer's queries sparse.
    selected: optional dict filled with `{layer: [P, H_kv, K]}` block indices the answer's queries chose.
    prefilled: `prefill(model, p_ids)`; the answer then runs on its cache (cropped back afterwards)."""
    from sas_backend.hf.sparse_eval import sparse_eval

    n = len(p_ids)
    ctx = contextlib.nullcontext() if spec is None else sparse_eval(model, spec, max_pos=n + len(a_ids),
                                                                    record=selected)
    with ctx:
        if prefilled is None:
            logits = model(torch.tensor(p_ids + a_ids)[None]).logits[0]
            pred = logits[n - 1:-1].float()  # row j predicts answer token j
        else:
            cache, last = prefilled
            try:
                logits = model(torch.tensor(a_ids)[None], past_key_values=cache, use_cache=True).logits[0]
            finally:
                cache.crop(n)
            pred = torch.cat([last[None], logits[:-1]]).float()
    target = torch.tensor(a_ids)
    nll = torch.nn.functional.cross_entropy(pred[code], target[code], reduction="sum")
    top1 = pred[code].argmax(-1) == target[code]
    return float(nll), bool(top1[0]), bool(top1.all())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--gate", action="append", default=None, metavar="NAME=DIR",
                    help="gate checkpoints (default: shipped=the shipped gate)")
    ap.add_argument("--context", type=int, default=3072, help="haystack tokens (as needle.py)")
    ap.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.25, 0.5, 0.75, 0.9])
    ap.add_argument("--budgets", type=int, nargs="+", default=[2048])
    ap.add_argument("--gate-forced", nargs="+", default=["1,1"], metavar="SINK,LOCAL")
    ap.add_argument("--baselines", nargs="*", default=["oracle", "quest", "sink-local"], choices=BASELINES)
    ap.add_argument("--answer", choices=ANSWERS, default="sentence",
                    help="teacher-forced answer: the needle sentence, or the passphrase alone (the server's answer)")
    ap.add_argument("--anchor-blocks", type=int, nargs="*", default=[], metavar="R",
                    help="also run each gate with R prompt-anchored blocks forced (inside the budget): per layer "
                         "and kv head, the blocks the prompt's last --anchor-window queries attended most")
    ap.add_argument("--anchor-window", type=int, default=1, help="prompt queries whose attention picks the anchors")
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", default=str(pathlib.Path(__file__).resolve().parent / "results"))
    args = ap.parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sas_backend.hf.sparse_eval import SparseEvalSpec, prompt_anchors

    started = time.time()
    gate_paths = parse_gates(args.gate or [f"shipped={default_gate(args.model)}"])
    tok = AutoTokenizer.from_pretrained(args.model)
    tok.model_max_length = 1 << 30
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    cases = needle_cases(tok, args.context, args.depths, args.answer)
    b = args.block_size
    # the fact's block, located by the passphrase as tokenized inside the needle sentence (the same prompts;
    # tokenized alone it may split differently from the haystack's text)
    blocks = [fact_block(p, a, c, b) for _, p, a, c in needle_cases(tok, args.context, args.depths, "sentence")]
    configs = [("dense", None)]
    for budget in args.budgets:
        k = budget // b
        for name, path in gate_paths.items():
            gates, _ = load_gates(path, model, b, torch.device("cpu"))
            for sink, local in parse_forced(args.gate_forced):
                configs.append((f"{name}+s{sink}l{local} b{budget}", dict(top_k=k, selector="gate", gates=gates,
                                                                          sink_blocks=sink, local_blocks=local)))
                for r in args.anchor_blocks:
                    configs.append((f"{name}+s{sink}l{local}+a{r} b{budget}",
                                    dict(top_k=k, selector="gate", gates=gates, sink_blocks=sink, local_blocks=local,
                                         anchors=r)))
        configs += [(f"{sel} b{budget}", dict(top_k=k, selector=sel)) for sel in args.baselines]
    rows = [{"selector": name, "scores": []} for name, _ in configs]
    for i_case, (depth, p_ids, a_ids, code) in enumerate(cases):  # one dense prefill per depth
        t0 = time.time()
        prefilled = prefill(model, p_ids)
        print(f"[needle_score] depth {depth:g} ({i_case + 1}/{len(cases)}): {len(p_ids)}-token prompt prefilled "
              f"in {time.time() - t0:.0f} s", flush=True)
        anchors = None  # computed once per prompt, when a row asks for them (the cache is left as prefilled)
        for row, (name, kw) in zip(rows, configs):
            if kw is not None and kw.get("anchors") is not None:
                if anchors is None:
                    anchors = prompt_anchors(model, p_ids, prefilled[0], max(args.anchor_blocks), args.anchor_window, b)
                kw = dict(kw, anchors={layer: a[:, :kw["anchors"]] for layer, a in anchors.items()})
            spec = None if kw is None else SparseEvalSpec(block_size=b, sparse_from=len(p_ids), **kw)
            selected = {}
            nll, top1, greedy = passphrase_nll(model, p_ids, a_ids, code, spec, selected, prefilled)
            block = blocks[i_case]
            # per layer: share of the answer's (query, kv head) pairs that chose the passphrase's block
            share = None if block is None or not selected else {
                str(layer): round(float((sel == block).any(-1).float().mean()), 3)
                for layer, sel in sorted(selected.items())}
            row["scores"].append({"depth": depth, "nll": round(nll, 3), "first_token_top1": top1,
                                  "all_tokens_top1": greedy, "fact_block": block, "fact_block_share_per_layer": share})
            print(f"[needle_score]   {name:28s} NLL {nll:6.2f}{' (first token top-1)' if top1 else ''}"
                  f"{' (every token top-1)' if greedy else ''}", flush=True)
        del prefilled

    head = "| selector | " + " | ".join(f"depth {d:g}" for d, *_ in cases) + " | sum |"
    lines = [head, "|" + "---|" * (len(cases) + 2)]
    for row in rows:
        cells = [f"{s['nll']:.2f}{' *' if s['first_token_top1'] else ''}{'+' if s['all_tokens_top1'] else ''}"
                 for s in row["scores"]]
        lines.append(f"| {row['selector']} | " + " | ".join(cells) + f" | {sum(s['nll'] for s in row['scores']):.2f} |")
    table = "\n".join(lines)
    date = datetime.date.today().isoformat()
    tag = f"needle-score-{date}" + (f"-{args.tag}" if args.tag else "")
    argv_used = sys.argv[1:] if argv is None else argv
    command = " ".join(shlex.quote(a) for a in ["python", "bench/needle_score.py", *argv_used])
    record = {
        "what": "needle, teacher-forced: NLL of the passphrase tokens (summed) after bench/needle.py's prompt, "
                "the answer's queries sparse under the serving rule (transformers + sas_backend.hf.sparse_eval)",
        "date": date, "commit": git_state()["commit"], "model": repo_relative(args.model),
        "gates": {n: repo_relative(p) for n, p in gate_paths.items()}, "context_tokens": args.context,
        "answer": args.answer,
        "rows": rows, "needle": NEEDLE, "question": QUESTION, "wall_s": round(time.time() - started, 1),
        "command": command, "table_markdown": table,
    }
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{tag}.json").write_text(json.dumps(record, indent=2))
    (out / f"{tag}.md").write_text(
        f"# Needle, teacher-forced, {date}\n\n{command} (commit {record['commit']})\n\n"
        f"NLL of the passphrase's tokens (summed, nats) after the needle prompt, the answer being the {args.answer}; "
        "`*`: its first token is the argmax, `+`: every one of its tokens is (greedy decoding writes the passphrase). "
        "Answer tokens are sparse queries under the serving rule.\n\n"
        f"{table}\n")
    print(table)
    print(f"[needle_score] wrote {out / (tag + '.json')} and {out / (tag + '.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
