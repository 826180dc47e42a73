"""The README's table from the results files: per text and budget, dense perplexity, the gate's perplexity change
vs dense with fp32 and with bf16 block summaries (the same windows), the bf16 - fp32 difference of the mean and
its largest per window, and the window noise (standard error over windows of the fp32 gate's per-window change).

    python bench/results/2026-12-01-bf16-summaries/table.py
"""

import json
import math
import os

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.dirname(HERE)
# (text, fp32 file, its variant, bf16 file, its variant): the served variant against its fp32 run on this machine
# (the recheck); s0l0 and quest against 2026-11-29's files (dense NLLs there within 5e-6 relative of this machine's)
ROWS = [
    ("SmolLM2, @handbook prose, 4096", "2026-12-01-bf16-summaries/smollm2-handbook-fp32-recheck.json", "shipped+s1l1",
     "2026-12-01-bf16-summaries/smollm2-handbook-bf16.json", "shipped+s1l1"),
    ("SmolLM2, @handbook prose, 4096, s0l0", "2026-11-29-gate-10x/quality-handbook-ood.json", "shipped+s0l0",
     "2026-12-01-bf16-summaries/smollm2-handbook-bf16.json", "shipped+s0l0"),
    ("SmolLM2, @site-packages code, 4096", "2026-12-01-bf16-summaries/smollm2-site-packages-fp32-recheck.json",
     "shipped+s1l1",
     "2026-12-01-bf16-summaries/smollm2-site-packages-bf16.json", "shipped+s1l1"),
    ("SmolLM2, @site-packages code, 4096, s0l0", "2026-11-29-gate-10x/quality-site-packages-ood.json", "shipped+s0l0",
     "2026-12-01-bf16-summaries/smollm2-site-packages-bf16.json", "shipped+s0l0"),
    ("SmolLM2, quest (baseline), @handbook", "2026-11-29-gate-10x/quality-handbook-ood.json", "quest",
     "2026-12-01-bf16-summaries/smollm2-handbook-bf16.json", "quest"),
    ("SmolLM2, quest (baseline), @site-packages", "2026-11-29-gate-10x/quality-site-packages-ood.json", "quest",
     "2026-12-01-bf16-summaries/smollm2-site-packages-bf16.json", "quest"),
    ("Qwen2.5-Coder-0.5B, @handbook prose, 8192", "2026-12-01-bf16-summaries/qwen-handbook-L8192-fp32.json", "qwen",
     "2026-12-01-bf16-summaries/qwen-handbook-L8192-bf16.json", "qwen"),
]


def load(rel):
    path = os.path.join(RESULTS, rel)
    return json.load(open(path)) if os.path.exists(path) else None


def main():
    print("| text | gate | budget | dense ppl | gate fp32 Δ | gate bf16 Δ | bf16 - fp32 (mean) | largest per window "
          "| window noise (s.e.) | windows |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for text, f32_rel, f32_name, b16_rel, b16_name in ROWS:
        f32, b16 = load(f32_rel), load(b16_rel)
        if f32 is None or b16 is None:
            continue
        assert b16.get("summary_dtype") == "bf16" and f32.get("summary_dtype", "fp32") == "fp32"
        n, last = b16["windows"], b16["last"]
        dense_w = b16["dense_nll_per_window"]
        assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(dense_w, f32["dense_nll_per_window"][:n]))
        dense = math.exp(sum(dense_w) / (n * last))
        gate = f32["gate_variants"].get(f32_name)
        label = f"{f32_name}" + (f" (sink {gate['sink_blocks']}, local {gate['local_blocks']}"
                                 + (f", anchors {gate['prompt_anchors']}" if gate.get("prompt_anchors") else "") + ")"
                                 if gate else "")
        for bud in [b["budget"] for b in b16["budgets"]]:
            a = f32["nll_per_window"][f32_name][str(bud)][:n]
            b = b16["nll_per_window"][b16_name][str(bud)]
            pa, pb = math.exp(sum(a) / (n * last)), math.exp(sum(b) / (n * last))
            per_w = [100 * (math.exp((y - x) / last) - 1) for x, y in zip(a, b)]  # bf16 vs fp32, % of ppl
            chg = [100 * (math.exp((x - d) / last) - 1) for x, d in zip(a, dense_w)]  # fp32 gate vs dense
            mean = sum(chg) / n
            se = math.sqrt(sum((c - mean) ** 2 for c in chg) / (n - 1) / n) if n > 1 else float("nan")
            worst = max(per_w, key=abs)
            print(f"| {text} | {label} | {bud} | {dense:.3f} | {100 * (pa / dense - 1):+.2f}% | "
                  f"{100 * (pb / dense - 1):+.2f}% | {100 * (pb / pa - 1):+.3f}% | {worst:+.3f}% | ±{se:.2f}% | {n} |")


if __name__ == "__main__":
    main()
