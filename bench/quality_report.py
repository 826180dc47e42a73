"""A quality report (per selector and budget, with the acceptance lines) from committed `eval_ppl` results.
docs/quality.md's report is written by `bench/readme_tables.py`, which calls `report()` here and is the one
script that writes (`--write`) and checks (CI) every generated table of the README and docs.

    .venv/bin/python bench/quality_report.py bench/results/<study>/quality-essays-X.json \
        bench/results/<study>/quality-code-X.json --gate shipped+s1l1 [--readme FILE]

For each results file: perplexity change vs dense per selector and budget, attention-mass recall,
whether its text is in-domain (a held-out split of a training corpus) or out-of-domain (a corpus no
training set touches), and the acceptance for the `--gate` selector, checked from the numbers (not
restated): it beats sink-local, quest and random at every budget; at budget 512 its change is at most
half of sink-local's and at most twice the oracle's; and, when the file has the same gate served with
and without forced blocks (NAME+s1l1 and NAME+s0l0), what dropping them costs at 512. `--readme`
replaces the text between `<!-- quality-report:begin -->` and `<!-- quality-report:end -->` in that file (links
relative to it); without it the Markdown is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
from typing import List

from sas_backend.corpus import OUT_OF_DOMAIN  # corpora no training set touches (no torch import)

BEGIN, END = "<!-- quality-report:begin -->", "<!-- quality-report:end -->"
# Training-free selectors a gate must beat, and the budget of the "half of sink-local" target.
RIVALS = ("sink-local", "quest", "random")
HALF_AT = 512
ORACLE_FACTOR = 2.0  # at HALF_AT the gate's change may be at most this times the oracle's


def change(res: dict, name: str, budget: int) -> float:
    """Perplexity change vs dense in percent."""
    return 100 * (res["results"][name][str(budget)] / res["dense"] - 1)


def recall(res: dict, name: str, budget: int):
    """Attention-mass recall pooled over layers, or None when the file has none."""
    per = (res.get("recall_per_layer") or {}).get(name, {}).get(str(budget))
    if not per:
        return None
    best = sum(b for _, b in per.values())
    return sum(c for c, _ in per.values()) / best if best else None


def acceptance(res: dict, gate: str) -> List[str]:
    """Lines saying, from the numbers, whether `gate` meets issue 8's targets in this file."""
    budgets = [b["budget"] for b in res["budgets"]]
    out = []
    for rival in RIVALS:
        if rival not in res["results"]:
            continue
        lost = [b for b in budgets if change(res, gate, b) >= change(res, rival, b)]
        out.append(f"{'met' if not lost else 'NOT met'}: {gate} beats {rival} at every budget"
                   + (f" (not at {', '.join(map(str, lost))})" if lost else ""))
    if HALF_AT in budgets and "sink-local" in res["results"]:
        g, s = change(res, gate, HALF_AT), change(res, "sink-local", HALF_AT)
        out.append(f"{'met' if g <= s / 2 else 'NOT met'}: at budget {HALF_AT} {gate} {g:+.1f}% vs half of "
                   f"sink-local's {s / 2:+.1f}%")
    if HALF_AT in budgets and "oracle" in res["results"]:
        g, o = change(res, gate, HALF_AT), change(res, "oracle", HALF_AT)
        # an oracle at or below dense leaves no room for a factor: then the gate must not be worse than dense
        limit = ORACLE_FACTOR * max(o, 0.0)
        out.append(f"{'met' if g <= limit else 'NOT met'}: at budget {HALF_AT} {gate} {g:+.1f}% vs "
                   f"{ORACLE_FACTOR:g}x the oracle's {o:+.1f}% ({limit:+.1f}%)")
    base, sep, _ = gate.rpartition("+")
    unforced = f"{base}+s0l0"
    if sep and gate != unforced and unforced in res["results"] and HALF_AT in budgets:
        g, u = change(res, gate, HALF_AT), change(res, unforced, HALF_AT)
        out.append(f"without forced blocks ({unforced}) at budget {HALF_AT}: {u:+.1f}% vs {g:+.1f}% "
                   f"({u - g:+.1f} points)")
    return out


def domain(res: dict) -> str:
    """"out-of-domain" when any source is a corpus no training set touches, else the split's name."""
    data = res.get("data", {})
    if any(s in OUT_OF_DOMAIN for s in data.get("sources", [])):
        return "out-of-domain"
    return "in-domain " + data.get("split", res.get("split", "heldout"))


def _link(target: pathlib.Path, base: pathlib.Path) -> str:
    """`target` as a relative link from the folder `base` (forward slashes)."""
    return pathlib.Path(os.path.relpath(target.resolve(), base.resolve())).as_posix()


def section(path: str, gate: str, base: pathlib.Path = pathlib.Path(".")) -> str:
    """Markdown for one results file; links are relative to the folder `base` (the page it goes into)."""
    res = json.loads(pathlib.Path(path).read_text())
    budgets = [b["budget"] for b in res["budgets"]]
    names = list(res["results"])
    has_recall = bool(res.get("recall_per_layer"))
    sources = ", ".join(res["data"].get("sources", []))
    lines = [
        f"**{sources}** ({domain(res)}): {res['windows']} windows of {res['window']} tokens, "
        f"last {res['last']} scored, dense perplexity {res['dense']:.3f}; "
        f"commit `{res.get('git', {}).get('commit', res.get('commit', '?'))[:7]}`, "
        f"{res['seconds'] / 60:.0f} min; record [`{pathlib.Path(path).name}`]({_link(pathlib.Path(path), base)}) "
        "(command inside, plots beside it).",
        "",
        "| perplexity change vs dense | " + " | ".join(f"B={b} (K={b // res['block_size']})" for b in budgets)
        + (" | recall " + " / ".join(map(str, budgets)) if has_recall else "") + " |",
        "|---|" + "---|" * (len(budgets) + has_recall),
    ]
    for name in sorted(names, key=lambda n: change(res, n, budgets[len(budgets) // 2])):
        cells = [f"{change(res, name, b):+.1f}%" for b in budgets]
        rec = [recall(res, name, b) for b in budgets]
        rec_cell = " | " + " / ".join("-" if r is None else f"{r:.3f}" for r in rec) if has_recall else ""
        bold = "**" if name == gate else ""
        lines.append(f"| {bold}{name}{bold} | " + " | ".join(cells) + f"{rec_cell} |")
    notes = (acceptance(res, gate) if gate in names else []) + res.get("checks", [])
    lines += [""] + [f"- {line}" for line in notes] if notes else []
    # the plots were written beside the JSON (the record names them by the path they had then; a study
    # folder may have moved since), so they are looked up beside it by file name
    plots = [pathlib.Path(path).parent / pathlib.Path(p_).name for p_ in res.get("plots", [])]
    plots = [p_ for p_ in plots if p_.is_file()]
    if plots:
        lines += [""] + [" ".join(f"![{p_.stem}]({_link(p_, base)})" for p_ in plots)]
    return "\n".join(lines)


def report(paths: List[str], gate: str, base: pathlib.Path = pathlib.Path(".")) -> str:
    """The whole generated block (one section per results file), links relative to `base`."""
    head = (f"Generated by `python bench/quality_report.py {' '.join(paths)} --gate {gate}` from the committed "
            "results; rows sorted by the middle budget.")
    return "\n\n".join([head] + [section(p, gate, base) for p in paths])


def replace_between_markers(text: str, block: str) -> str:
    """`text` with the part between BEGIN and END replaced by `block`; ValueError without markers."""
    if BEGIN not in text or END not in text or text.index(BEGIN) > text.index(END):
        raise ValueError(f"no {BEGIN} ... {END} markers")
    before, rest = text.split(BEGIN, 1)
    _, after = rest.split(END, 1)
    return f"{before}{BEGIN}\n{block}\n{END}{after}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+", help="eval_ppl --json files")
    ap.add_argument("--gate", required=True, help="the selector name (as in the results) the acceptance is about")
    ap.add_argument("--readme", default=None, help="rewrite the marked block of this file instead of printing")
    args = ap.parse_args(argv)
    base = pathlib.Path(args.readme).parent if args.readme else pathlib.Path(".")
    block = report(args.results, args.gate, base)
    if args.readme is None:
        print(block)
        return 0
    path = pathlib.Path(args.readme)
    try:
        path.write_text(replace_between_markers(path.read_text(), block))
    except ValueError as e:
        print(f"error: {args.readme}: {e}", file=sys.stderr)
        return 2
    print(f"[quality_report] rewrote the quality block of {args.readme}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
