"""The README's tables from this study's JSON files: python bench/results/2026-12-01-coverage-analysis/table.py"""

import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
TEXTS = (("@handbook prose", "smollm2-handbook"), ("@site-packages code", "smollm2-site-packages"))
# (title, file suffixes): the sparse-activation runs (and the random control run apart), the dense-activation runs
SETS = (("sparse activations (as served)", ("", "-random")), ("dense activations", ("-dense-activations",)))


def rows(suffixes):
    for text, stem in TEXTS:
        for suffix in suffixes:
            path = os.path.join(HERE, stem + suffix + ".json")
            if not os.path.exists(path):
                continue
            rec = json.load(open(path))
            for sel, per in rec["results"].items():
                for bud in (str(b["budget"]) for b in rec["budgets"]):
                    yield text, sel, int(bud), per[bud], rec


def coverage_table(suffixes):
    out = ["| text | selector | budget | coverage raw | coverage value-aware | weakest 3 layers, raw | ppl vs dense |",
           "|---|---|---|---|---|---|---|"]
    for text, sel, bud, r, rec in rows(suffixes):
        weak = ", ".join(f"L{k} {v:.2f}" for k, v in sorted(r["coverage_raw"].items(), key=lambda kv: kv[1])[:3])
        ppl = "-" if r["ppl"] is None else f"{100 * (r['ppl'] / rec['dense_ppl'] - 1):+.1f}%"
        out.append(f"| {text} | {sel} | {bud} | {r['coverage_raw_mean']:.3f} | {r['coverage_value_mean']:.3f} | "
                   f"{weak} | {ppl} |")
    return "\n".join(out)


def recall_table(suffixes):
    out = ["| text | selector | budget | per-layer recall | union recall per kv head (h0 / h1 / h2) | **mean over "
           "kv heads** | all heads | union blocks per kv head: oracle / selected | all heads: oracle / selected | "
           "candidates |", "|---|---|---|---|---|---|---|---|---|---|"]
    for text, sel, bud, r, _ in rows(suffixes):
        u = r["union_blocks"]
        kv = " / ".join(f"{x:.3f}" for x in r["union_recall_per_kv_head"])
        out.append(f"| {text} | {sel} | {bud} | {r['layer_recall_mean']:.3f} | {kv} | "
                   f"**{r['union_recall_kv_mean']:.3f}** | {r['union_recall_all_heads']:.3f} | "
                   f"{u['oracle_per_kv_head']:.1f} / {u['selected_per_kv_head']:.1f} | "
                   f"{u['oracle_all_heads']:.1f} / {u['selected_all_heads']:.1f} | {u['candidates']:.1f} |")
    return "\n".join(out)


def layers_above_oracle(suffixes):
    """Per text, selector and budget: the layers where the selector's raw coverage exceeds the oracle's."""
    got = {}
    for text, sel, bud, r, rec in rows(suffixes):
        if sel == "oracle":
            continue
        oracle = rec["results"].get("oracle", {}).get(str(bud))
        if oracle is None:
            continue
        above = [int(k) for k, v in r["coverage_raw"].items() if v > oracle["coverage_raw"][k]]
        got[(text, sel, bud)] = above
    return got


def main():
    for title, suffixes in SETS:
        print(f"### {title}\n")
        print(coverage_table(suffixes))
        print()
        print(recall_table(suffixes))
        above = {k: v for k, v in layers_above_oracle(suffixes).items() if v}
        print("\nLayers where a selector's raw coverage exceeds the oracle's: "
              + ("; ".join(f"{t}, {s} at {b}: {', '.join(map(str, v))}" for (t, s, b), v in above.items()) or "none")
              + "\n")


if __name__ == "__main__":
    main()
