"""The README's picture: decode-step latency vs context, dense vs sas, from cpu-decode-2026-11-23.json.

    .venv/bin/python bench/results/2026-11-23-cpu-decode/plot_latency.py   # writes decode-latency.png beside it

Latency of one decode step = batch / (decode tokens/s of the whole batch), the inverse of the
throughput bench/bench_cpu_decode.py measured (no new measurement).
"""

import json
import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
res = json.loads((HERE / "cpu-decode-2026-11-23.json").read_text())
fig, axes = plt.subplots(1, 2, figsize=(10, 4))
for ax, batch in zip(axes, (1, 8)):
    rows = sorted((r for r in res["rows"] if r["batch"] == batch), key=lambda r: r["context"])
    ctx = [r["context"] for r in rows]
    ax.plot(ctx, [1000 * batch / r["dense_tok_s"] for r in rows], "o-", color="black", label="dense (torch_native)")
    for budget, color in (("512", "tab:blue"), ("1024", "tab:orange")):
        ax.plot(ctx, [1000 * batch / r["sas"][budget]["tok_s"] for r in rows], "s-", color=color,
                label=f"sas, budget {budget}")
    ax.set_title(f"batch {batch}")
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("decode step latency (ms)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
m = res["machine"]
fig.suptitle(f"Decode latency vs context, SmolLM2-135M-Instruct fp32 on CPU ({m['cpu']}, {m['cores']} cores), "
             f"sglang {m['sglang']}, {res['date']}", fontsize=10)
fig.tight_layout()
fig.savefig(HERE / "decode-latency.png", dpi=100)
print(HERE / "decode-latency.png")
