"""The README's tables from the results files: per gate, text and budget, the gate's perplexity with fp32 gate
weights and fp32 summaries (the reference, 2026-12-01-bf16-summaries) and with bf16 gate weights and bf16
summaries (this study, the same windows), their change; then, paired window by window, the change of the mean and
its largest per window, the window noise (standard error over windows of the fp32 gate's per-window change vs
dense), and the part of the change the gate weights make on their own (against the fp32-weights, bf16-summaries
run of 2026-12-01-bf16-summaries).

    python bench/results/2026-12-01-bf16-gate-weights/table.py
"""

import json
import math
import os

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.dirname(HERE)
REF = "2026-12-01-bf16-summaries"
# (text, variant, fp32 reference, fp32 weights + bf16 summaries, bf16 weights + bf16 summaries): the same variant in
# each, the gate as served
ROWS = [
    ("SmolLM2, @handbook prose, 4096", "shipped+s1l1", f"{REF}/smollm2-handbook-fp32-recheck.json",
     f"{REF}/smollm2-handbook-bf16.json", "2026-12-01-bf16-gate-weights/smollm2-handbook-bf16.json"),
    ("SmolLM2, @site-packages code, 4096", "shipped+s1l1", f"{REF}/smollm2-site-packages-fp32-recheck.json",
     f"{REF}/smollm2-site-packages-bf16.json", "2026-12-01-bf16-gate-weights/smollm2-site-packages-bf16.json"),
    ("Qwen2.5-Coder-0.5B, @handbook prose, 8192", "qwen", f"{REF}/qwen-handbook-L8192-fp32.json",
     f"{REF}/qwen-handbook-L8192-bf16.json", "2026-12-01-bf16-gate-weights/qwen-handbook-L8192-bf16.json"),
]


def load(rel):
    path = os.path.join(RESULTS, rel)
    return json.load(open(path)) if os.path.exists(path) else None


def dtypes(js):
    return js.get("gate_dtype", "fp32"), js.get("summary_dtype", "fp32")


def ppl(nll, n, last):
    return math.exp(sum(nll) / (n * last))


def main():
    main_rows, paired_rows = [], []
    for text, name, f32_rel, summ_rel, b16_rel in ROWS:
        f32, summ, b16 = load(f32_rel), load(summ_rel), load(b16_rel)
        if f32 is None or b16 is None:
            continue
        assert dtypes(f32) == ("fp32", "fp32") and dtypes(b16) == ("bf16", "bf16")
        assert summ is None or dtypes(summ) == ("fp32", "bf16")
        n, last = b16["windows"], b16["last"]
        dense_w = b16["dense_nll_per_window"]
        assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(dense_w, f32["dense_nll_per_window"][:n]))
        dense = ppl(dense_w, n, last)
        gate = b16["gate_variants"][name]
        label = (f"{name} (sink {gate['sink_blocks']}, local {gate['local_blocks']}"
                 + (f", anchors {gate['prompt_anchors']}" if gate.get("prompt_anchors") else "") + ")")
        for bud in [b["budget"] for b in b16["budgets"]]:
            a = f32["nll_per_window"][name][str(bud)][:n]
            b = b16["nll_per_window"][name][str(bud)]
            pa, pb = ppl(a, n, last), ppl(b, n, last)
            per_w = [100 * (math.exp((y - x) / last) - 1) for x, y in zip(a, b)]  # bf16 vs fp32, % of ppl
            chg = [100 * (math.exp((x - d) / last) - 1) for x, d in zip(a, dense_w)]  # fp32 gate vs dense
            mean = sum(chg) / n
            se = math.sqrt(sum((c - mean) ** 2 for c in chg) / (n - 1) / n) if n > 1 else float("nan")
            worst = max(per_w, key=abs)
            main_rows.append(f"| {text} | {bud} | {dense:.3f} | {pa:.3f} ({100 * (pa / dense - 1):+.2f}%) | "
                             f"{pb:.3f} ({100 * (pb / dense - 1):+.2f}%) | {100 * (pb / pa - 1):+.3f}% | {n} |")
            own = "- | -"
            if summ is not None:  # the weights' own part: bf16 weights + bf16 summaries vs fp32 weights + bf16 ones
                s = summ["nll_per_window"][name][str(bud)][:n]
                per_s = [100 * (math.exp((y - x) / last) - 1) for x, y in zip(s, b)]
                own = f"{100 * (pb / ppl(s, n, last) - 1):+.3f}% | {max(per_s, key=abs):+.3f}%"
            paired_rows.append(f"| {text} | {label} | {bud} | {100 * (pb / pa - 1):+.3f}% | {worst:+.3f}% | "
                               f"±{se:.2f}% | {own} | {n} |")
    print("| text (windows) | budget | dense ppl | gate ppl, fp32 weights + fp32 summaries (vs dense) "
          "| gate ppl, bf16 weights + bf16 summaries (vs dense) | change | windows |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(main_rows))
    print()
    print("| text | gate | budget | bf16 - fp32 (mean) | largest per window | window noise (s.e.) "
          "| weights alone: vs bf16 summaries (mean) | weights alone: largest per window | windows |")
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(paired_rows))


if __name__ == "__main__":
    main()
