"""Profile one decode step of the `sas` backend on CPU: torch ops per sparse layer, and time.

No server and no model weights: the real backend on SGLang's real CPU pools with the default
model's attention geometry (SmolLM2-135M: 30 layers, 9 q / 3 kv heads, head dim 64) and the
shipped gate, random K/V in the cache and random q per layer, so the numbers are those of the
attention step alone (what the backend adds to a decode step). Beside it, SGLang's dense
`torch_native` decode on the same cache.

    .venv/bin/python bench/profile_decode_step.py                    # writes bench/results/
    .venv/bin/python bench/profile_decode_step.py --contexts 1024 7680 --batches 1 8 --budget 512
    .venv/bin/python bench/profile_decode_step.py --contexts 7680 --exact-rerank 1 2 --rerank-passes one two

It drives only the backend's public hooks (`init_forward_metadata`, `forward_decode`), so the same
script profiles an older commit of the backend too (`--label before`).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import pathlib
import platform
import time
from types import SimpleNamespace

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]
GATE = REPO / "gate_checkpoints" / "smollm2-135m-instruct-sas"
LAYERS, H_Q, H_KV, D, B = 30, 9, 3, 64, 64


class _OpCounter(TorchDispatchMode):
    """Counts every aten op dispatched (each is one kernel launch on CPU)."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def build(budget: int, max_ctx: int, max_reqs: int, backend: str, exact_rerank: int = 1):
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

    from sas_backend.backend.rope_tables import FixedRopeTables
    from sas_backend.backend.sas_attention import SASAttnBackend
    from sas_backend.config import SASConfig
    from sas_backend.gate.checkpoint import load_gate_checkpoint
    from sas_backend.gate.module import gates_from_tensors
    from sas_backend.ops.rope import rope_cos_sin_table

    req_pool = ReqToTokenPool(max_reqs, max_ctx, "cpu", False)
    kv_pool = MHATokenToKVPool(max_reqs * max_ctx + B, B, torch.float32, H_KV, D, LAYERS, "cpu", False)
    runner = SimpleNamespace(
        device="cpu", req_to_token_pool=req_pool, token_to_kv_pool=kv_pool, dtype=torch.float32,
        model=None, page_size=B,
    )
    layers = [RadixAttention(H_Q, D, D**-0.5, H_KV, lid) for lid in range(LAYERS)]
    inner = TorchNativeAttnBackend(runner)
    if backend == "dense":
        return inner, req_pool, kv_pool, layers, None
    gate_cfg, tensors = load_gate_checkpoint(GATE)
    gates = gates_from_tensors(tensors, range(LAYERS), gate_dim=gate_cfg.gate_dim, device="cpu")
    cfg = SASConfig(gate_path=str(GATE), budget=budget, block_size=B, exact_rerank=exact_rerank)
    sas = SASAttnBackend(
        runner, inner, cfg, gates,
        FixedRopeTables(rope_cos_sin_table(D, max_ctx, 100000.0),
                        rope_cos_sin_table(gate_cfg.gate_dim, max_ctx, 100000.0)),
        num_kv_heads=H_KV, num_q_heads=H_Q, head_dim=D,
    )
    for lid in range(LAYERS):  # every page summarized (values do not matter for cost)
        sas.summaries[lid].normal_()
    return sas, req_pool, kv_pool, layers, sas


def run_point(backend_name: str, ctx: int, bs: int, budget: int, steps: int, exact_rerank: int = 1,
              one_pass: bool = True) -> dict:
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    be, req_pool, kv_pool, layers, sas = build(budget, ctx + 2 * B, bs + 1, backend_name, exact_rerank)
    if sas is not None:  # two levels: rank and attend over one gather (the default off CUDA), or in two passes
        sas.step.rerank_attends = one_pass
    g = torch.Generator().manual_seed(0)
    for lid in range(LAYERS):
        kv_pool.k_buffer[lid].normal_(generator=g)
        kv_pool.v_buffer[lid].normal_(generator=g)
    width = req_pool.req_to_token.shape[1]
    for r in range(bs):  # request r owns slots [r*width + B, ...): whole pages, page 0 left free
        req_pool.req_to_token[r + 1, :width] = torch.arange(width, dtype=torch.int32) + r * width + B
    reqs = torch.arange(1, bs + 1)
    q = [torch.randn(bs, H_Q * D, generator=g) for _ in range(LAYERS)]
    kv = [(torch.randn(bs, H_KV, D, generator=g), torch.randn(bs, H_KV, D, generator=g)) for _ in range(LAYERS)]

    def step(seq_len):
        seq_lens = torch.full((bs,), seq_len, dtype=torch.int64)
        fb = SimpleNamespace(
            forward_mode=ForwardMode.DECODE, batch_size=bs, seq_lens=seq_lens, seq_lens_cpu=seq_lens.clone(),
            positions=seq_lens - 1, req_pool_indices=reqs, encoder_lens=None,
            out_cache_loc=req_pool.req_to_token[reqs, seq_len - 1].long(),
        )
        be.init_forward_metadata(fb)
        for layer, qi, (ki, vi) in zip(layers, q, kv):
            be.forward_decode(qi, ki, vi, layer, fb)

    with torch.no_grad():
        for i in range(3):  # warm-up
            step(ctx - 3 + i)
        counter = _OpCounter()
        with counter:
            step(ctx)
        t0 = time.perf_counter()
        for i in range(steps):
            step(ctx + 1 + (i % B))
        dt = (time.perf_counter() - t0) / max(steps, 1)
    total = sum(counter.counts.values())
    return {
        "backend": backend_name, "context": ctx, "batch": bs, "budget": budget if sas else None,
        "exact_rerank": exact_rerank if sas else None,
        "rerank_pass": ("one" if one_pass else "two") if sas is not None and exact_rerank > 1 else None,
        "ms_per_step_all_layers": round(dt * 1e3, 3) if steps else None, "aten_ops_per_layer": round(total / LAYERS, 1),
        "top_ops": dict(counter.counts.most_common(12)),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 7680])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--steps", type=int, default=10, help="timed steps; 0 counts ops only (busy machine)")
    ap.add_argument("--exact-rerank", type=int, nargs="+", default=[1], metavar="X",
                    help="sas with one level (1) and / or two (--sas-exact-rerank X), side by side")
    ap.add_argument("--rerank-passes", nargs="+", default=["one"], choices=["one", "two"],
                    help="two levels: rank and attend over one gather of the candidates (one, the CPU default) "
                         "and / or the second level, then the sparse decode (two), side by side")
    ap.add_argument("--label", default="after", help="names the result file (e.g. before / after)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads (default: every core)")
    ap.add_argument("--out", default=str(REPO / "bench" / "results"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for ctx in args.contexts:
        for bs in args.batches:
            d = run_point("dense", ctx, bs, args.budget, args.steps)
            rows.append(d)
            one_level = None
            for x in args.exact_rerank:
                for passes in (args.rerank_passes if x > 1 else ["one"]):
                    s = run_point("sas", ctx, bs, args.budget, args.steps, x, passes == "one")
                    rows.append(s)
                    one_level = s if x == 1 else one_level
                    name = "sas" if x == 1 else f"sas X={x} ({passes} pass)"
                    line = (f"ctx {ctx:5d} bs {bs}: ops/layer dense {d['aten_ops_per_layer']:5.1f} "
                            f"{name} {s['aten_ops_per_layer']:5.1f}")
                    if args.steps:
                        dm, sm = d["ms_per_step_all_layers"], s["ms_per_step_all_layers"]
                        line += f" | ms/step dense {dm:8.2f} {name} {sm:8.2f} | dense/sas {dm / sm:.2f}x"
                        if x > 1 and one_level is not None:
                            line += f" | one level / this {one_level['ms_per_step_all_layers'] / sm:.2f}x"
                    print(line, flush=True)
    from sas_backend.provenance import git_state

    commit = git_state()["commit"][:7]
    import sglang

    record = {
        "what": "attention step of one decode step (all 30 layers), SmolLM2-135M geometry, fp32, CPU",
        "command": "python bench/profile_decode_step.py " + " ".join(
            f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
            for k, v in vars(args).items() if k != "out"
        ),
        "label": args.label, "commit": commit, "date": datetime.date.today().isoformat(),
        "machine": {"cpu": _cpu_name(), "cores": os.cpu_count(), "python": platform.python_version()},
        "versions": {"torch": torch.__version__, "sglang": sglang.__version__},
        "rows": rows,
    }
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"profile-decode-step-cpu-{args.label}-{record['date']}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    raise SystemExit(main())
