"""Compile every Triton kernel of sas_backend for sm_90 (H100) on a machine without a GPU.

The package's own Triton launchers (`sas_backend/ops/*/triton.py`, the gated training kernel's
forward and backward) are called on CPU tensors with `JITFunction.run` replaced by a recorder: it
binds the arguments exactly as a real launch does (Triton's own binder: dtypes, constexprs,
"== 1" ints turned into constants, divisibility-by-16 attributes, options such as num_warps) and
launches nothing. Each distinct compile key is then compiled for `cuda:90` with `triton.compile`,
ptxas runs with `-v`, and the table (kernel, geometry, constexprs, warps/stages, registers, spills,
shared memory) is written as JSON + Markdown.

Geometry (block size 64). The constexpr-determining axes are swept in full product: head dim
64/128, gate dim 64/128, G = H_q/H_kv 1/2/3/4/7/8, bf16/fp16/fp32 wherever a launcher accepts
them, budgets 512-4096 tokens (K = 8..64), and widths M (max blocks) that reach every
tile-size constexpr (M = 1 .. 4095, i.e. up to 256K tokens). Runtime ints (batch, kv heads,
M as a stride, forced blocks) only change Triton's "== 1" / "% 16" specialization: they are swept
at one geometry (D = Dg = 128, G = 4, bf16, K = 32; Qwen3-4B-like) over batch 1/8/16,
H_kv 1/8, M 640/2047/2048/4096 and forced blocks (0,0)/(1,1)/(1,2). Kernels whose code does not
depend on an axis collapse to one compiled variant (the table lists the geometries behind each).

Fails (exit 1) on a compile error, on shared memory above the H100's 227 KiB opt-in limit, on a
register spill in a serving (decode-step) kernel, or on a @triton.jit function of the package
that no recorded launch compiles (directly or as a callee). Spills in the training kernels are
reported, not failed: see TRAINING_SPILLS_FAIL.

    python gpu_kit/compile_triton.py --out DIR                    # installed Triton and 3.6.0
    python gpu_kit/compile_triton.py --out DIR --triton installed # only the one in this venv
    python gpu_kit/compile_triton.py --out DIR --triton 3.6.0     # only 3.6.0 (the GPU image's)
    python gpu_kit/compile_triton.py --out DIR --grid ci          # the test's grid (below)

`--grid ci` (tests/test_triton_sm90_compile.py) is the full grid less the fp32 training kernels
outside one geometry (CI_FP32_TRAINING): fp32 there means IEEE fp32 dots that spill tens of KB
per thread, and ptxas then takes 20-40 CPU s per variant (about 10 CPU minutes per version); and
less the fp16 training kernels (the bf16 ones compile the same code with the other 16-bit type; the
full grid compiles both: bench/results/2026-11-25-triton-sm90), a minute of CI wall time; and less
the products whose every axis value it still compiles (Top-K's K x width, the summary update's geometry x
dtype, the fused step's sweep; `cases` says which), about 40 more CPU s; and it compiles one variant per
configuration (`one_per_configuration`: the "== 1" / "% 16" specializations of runtime ints change no tile),
about 50 more CPU s.

A version other than "installed" is pip-installed (--no-deps --target) into build/triton-<v>/
(git-ignored) on first use and put first on PYTHONPATH of a subprocess that runs this same file.
Writes DIR/triton-<version>.json and DIR/triton-<version>.md per version.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import io
import itertools
import json
import os
import pathlib
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import warnings

REPO = pathlib.Path(__file__).resolve().parents[1]
GPU_IMAGE_TRITON = "3.6.0"
SMEM_LIMIT = 232448  # H100: 227 KiB of shared memory per block (opt-in maximum)
BLOCK = 64
# Training kernels run per training step, not per decode token, and spill only a few hundred
# bytes in bf16/fp16 (at 255 registers, head dim 128); fp32 (the trainer's reference and test
# precision) spills tens of KB. A spill costs speed, not correctness: reported, not failed.
TRAINING_SPILLS_FAIL = False
EXIT_FETCH = 3  # exit status when a Triton version cannot be fetched (the test skips on it)

# Modules holding the package's @triton.jit functions (coverage is checked against all of them).
KERNEL_MODULES = (
    "sas_backend.ops.gate.triton",
    "sas_backend.ops.summary.triton",
    "sas_backend.ops.late_blocks.triton",
    "sas_backend.ops.score.triton",
    "sas_backend.ops.topk.triton",
    "sas_backend.ops.gather.triton",
    "sas_backend.ops.fused_step.triton",
    "sas_backend.ops.rerank.triton",
    "sas_backend.ops.key_codes.triton",
    "sas_backend.training.ops.gated_attention.fused",
)
TRAINING_MODULES = ("sas_backend.training.",)

# ----------------------------------------------------------------------------------- the grid
HEAD_DIMS = (64, 128)
GATE_DIMS = (64, 128)
GROUPS = (1, 2, 3, 4, 7, 8)
DTYPES = ("bf16", "fp16", "fp32")
BUDGETS = (512, 1024, 2048, 4096)  # tokens of previous blocks: K = budget / 64
# Max-block widths hitting every value of the width-derived constexprs: score's BLOCK_M
# (1..64), topk's CHUNK (16..1024, single chunk) and the two-phase merge's TILE (2 and 4 chunks).
WIDTHS = (1, 2, 3, 5, 9, 17, 33, 65, 129, 257, 513, 2047, 4095)
BASE = dict(bs=8, h_kv=8, sink=1, local=1, n=37, m=2047)  # runtime ints of the geometry sweep
SPEC_GEOMETRY = dict(d=128, dg=128, g=4, dtype="bf16", k=32)
SPEC_BATCH, SPEC_KV_HEADS, SPEC_PAGES = (1, 8, 16), (1, 8), (1, 37, 64)
SPEC_WIDTHS = (640, 2047, 2048, 4096)  # Qwen3-4B's 40K graph width, 128K eager/graph, 256K graph
SPEC_FORCED = ((0, 0), (1, 1), (1, 2))
# The runtime ints each launcher takes (the others would only clutter its geometry label).
RUNTIME_KEYS = dict(gate_query=("bs", "h_kv"), summarize_pages=("h_kv", "n"), summary_update=("bs", "h_kv", "m"),
                    summarize_listed=("h_kv",), late_blocks=("bs", "m"),
                    score=("bs", "h_kv", "m"), topk=("bs", "h_kv", "m", "sink", "local"),
                    gather=("bs", "h_kv", "m"), gated_attention=(), decode_front=("bs", "h_kv"),
                    decode_select=("bs", "h_kv", "m", "sink", "local"), decode_attend=("bs", "h_kv"),
                    rerank=("bs", "h_kv"), key_codes=("h_kv",))
# The one fp32 training geometry of the CI grid: the cheapest (about 20 CPU s for its 4 kernels).
CI_FP32_TRAINING = dict(d=64, g=1)
CI_HALF_TRAINING = ("bf16",)  # the 16-bit training dtype of the CI grid
CI_TOPK_WIDTHS = (65, 2047)  # the widths at which the CI grid compiles Top-K for every K (the full: all WIDTHS)


def product(**axes) -> list[dict]:
    """Every combination of the axes' values, as dicts."""
    names = list(axes)
    return [dict(zip(names, vals)) for vals in itertools.product(*(axes[n] for n in names))]


def cases(grid: str = "full") -> dict[str, list[dict]]:
    """{op: [params]}: the geometry sweep (at BASE's runtime ints) plus the specialization sweep.
    grid "ci" is "full" less fp32 training outside CI_FP32_TRAINING, 16-bit training other than
    CI_HALF_TRAINING, Top-K's K x width product (every width at the spec K, every K at CI_TOPK_WIDTHS), the
    summary update's geometry x dtype product, and the fused step's sweep (its spec-geometry variants)."""
    spec = product(bs=SPEC_BATCH, h_kv=SPEC_KV_HEADS)
    width_spec = product(bs=SPEC_BATCH, h_kv=SPEC_KV_HEADS, m=SPEC_WIDTHS)
    sg = SPEC_GEOMETRY
    ks = [b // BLOCK for b in BUDGETS]
    full = grid == "full"
    out = {
        # split: the serving launch (partials + finish); unsplit: the one-launch kernel the benchmark times beside it
        "gate_query": product(d=HEAD_DIMS, dg=GATE_DIMS, g=GROUPS, dtype=DTYPES, split=(True, False))
        + [dict(d=sg["d"], dg=sg["dg"], g=sg["g"], dtype=sg["dtype"], split=True, **s) for s in spec],
        "summarize_pages": product(d=HEAD_DIMS, dg=GATE_DIMS, dtype=DTYPES)
        + [dict(d=sg["d"], dg=sg["dg"], dtype=sg["dtype"], **s)
           for s in product(h_kv=SPEC_KV_HEADS, n=SPEC_PAGES)]
        # sub-block runs (BLOCK / SUB tokens a run) at extend and in the per-op decode update
        + product(d=HEAD_DIMS, dg=GATE_DIMS, dtype=("bf16", "fp32"), sub=SERVED_SUB_BLOCKS)
        # an fp8 KV cache (issue 66): fp8 keys, one and SUB runs a block
        + [dict(d=sg["d"], dg=sg["dg"], dtype="bf16", kv=kv, **sub) for kv in SERVED_FP8
           for sub in [{}] + [dict(sub=n) for n in SERVED_SUB_BLOCKS]],
        # The late blocks of the device-side validity marks (a PD decode server's transferred pages): every (d, dg)
        # in the model dtypes served, both summary dtypes, SUB runs a block, fp8 keys.
        "summarize_listed": product(d=HEAD_DIMS, dg=GATE_DIMS, dtype=("bf16", "fp16"), summaries=("fp32", "bf16"))
        + [dict(d=sg["d"], dg=sg["dg"], dtype="bf16", summaries=sm, **x) for sm in ("fp32", "bf16")
           for x in [dict(sub=n) for n in SERVED_SUB_BLOCKS] + [dict(kv=kv) for kv in SERVED_FP8]],
        # The step's late-block list (int64 tables, bool marks): one variant whatever the geometry.
        "late_blocks": [dict(bs=bs, m=m) for bs, m in ((1, 127), (8, 2047))],
        # The CI grid: every (d, dg) in bf16 and every dtype at the spec geometry, not their product.
        "summary_update": (product(d=HEAD_DIMS, dg=GATE_DIMS, dtype=DTYPES, summaries=("fp32", "bf16")) if full else
                           product(d=HEAD_DIMS, dg=GATE_DIMS, dtype=("bf16",), summaries=("fp32",))
                           + product(d=(sg["d"],), dg=(sg["dg"],), dtype=DTYPES, summaries=("fp32", "bf16")))
        + [dict(d=sg["d"], dg=sg["dg"], dtype=sg["dtype"], summaries="fp32", **s) for s in width_spec]
        + [dict(d=sg["d"], dg=sg["dg"], dtype="bf16", kv=kv, summaries=sm) for kv in SERVED_FP8
           for sm in ("fp32", "bf16")],
        # The serving path scores an fp32 gate query against fp32 summaries; the launcher also
        # takes other float dtypes, compiled at the base width.
        "score": product(dg=GATE_DIMS, m=WIDTHS, gate_q=("fp32",), summaries=("fp32",))
        + product(dg=GATE_DIMS, gate_q=DTYPES, summaries=("fp32", "bf16"))
        # sub-block summaries: the per-op gate path past the fused rows scores the best of SUB runs
        + product(dg=(sg["dg"],), m=WIDTHS[:8], gate_q=("fp32",), summaries=("fp32", "bf16"), sub=SERVED_SUB_BLOCKS)
        + [dict(dg=sg["dg"], gate_q="fp32", summaries="fp32", **s) for s in width_spec],
        # The CI grid: every width at the spec K, every K at CI_TOPK_WIDTHS (one chunk and two-phase), not the product.
        "topk": (product(k=ks, m=WIDTHS) if full else
                 product(k=(sg["k"],), m=WIDTHS) + product(k=[k for k in ks if k != sg["k"]], m=CI_TOPK_WIDTHS))
        + [dict(k=sg["k"], sink=f[0], local=f[1], **s) for s in width_spec for f in SPEC_FORCED],
        "gather": product(k=ks, m=WIDTHS) + [dict(k=sg["k"], **s) for s in width_spec],
        # The fused decode step (ops/fused_step): every group and dim in bf16, the dtypes at the spec geometry.
        # The CI grid keeps the spec geometry's variants only (G 4 and 1, both dtypes of the pool and weights, the
        # fp32 K/V tiles that spilled once, the widest select): compiling the full set took ~8 min of CI.
        "decode_front": (product(d=HEAD_DIMS, dg=GATE_DIMS, g=GROUPS, dtype=("bf16",), weights=("fp32",),
                                 summaries=("fp32",))
                         + product(d=(sg["d"],), dg=(sg["dg"],), g=(sg["g"],), dtype=DTYPES, weights=("fp32", "bf16"),
                                   summaries=("fp32", "bf16"))) if full else
        [dict(d=sg["d"], dg=sg["dg"], g=g, dtype="bf16", weights=w, summaries=w) for g in (1, sg["g"])
         for w in ("fp32", "bf16")]
        + [dict(d=64, dg=sg["dg"], g=sg["g"], dtype="fp32", weights="fp32", summaries="fp32")],
        "decode_select": (product(dg=GATE_DIMS, k=ks, m=(1, 65, 2047, 4095), anchors=(0,))
                          + [dict(dg=sg["dg"], k=sg["k"], anchors=4, sink=1, local=1, bs=1, h_kv=8, m=w)
                             for w in SPEC_WIDTHS]) if full else
        [dict(dg=sg["dg"], k=sg["k"], anchors=a, sink=1, local=1, bs=1, h_kv=8, m=m) for a, m in ((0, 65), (4, 4096))],
        "decode_attend": ((product(d=HEAD_DIMS, g=GROUPS, dtype=DTYPES, k=(sg["k"],))
                          + [dict(d=sg["d"], g=sg["g"], dtype=sg["dtype"], k=k, **s) for s in spec for k in ks])
        if full else [dict(d=d, g=sg["g"], dtype=dt, k=sg["k"])
                      for d, dt in ((128, "bf16"), (128, "fp32"), (64, "fp16"))])
        # the attend ranking two levels' candidates over fp32 K / V (16 warps: `ops.fused_step._attend_warps`)
        + [dict(d=d, g=sg["g"], dtype="fp32", k=sg["k"], x=x) for d in HEAD_DIMS for x in (2, 4)],
        # The exact second level (--sas-exact-rerank X): first levels of X x K blocks (CP, K_TILE), every group and
        # dim in bf16, the dtypes (fp8 keys with bf16 queries) at the spec geometry; the CI grid: the spec geometry at
        # the serve default K with X = 2 and 4, G 1 and 7, fp32 and fp8 keys, anchors.
        "rerank": ((product(d=HEAD_DIMS, g=GROUPS, dtype=("bf16",), k=(sg["k"],), x=(2,))
                    + [dict(d=sg["d"], g=sg["g"], dtype=dt, k=k, x=x, anchors=SERVED_ANCHORS)
                       for dt in ("bf16", "fp32", "fp8e4", "fp8e5") for k in ks for x in (2, 4)]) if full else
                   [dict(d=sg["d"], g=g, dtype="bf16", k=sg["k"], x=x, anchors=SERVED_ANCHORS) for g in (1, sg["g"], 7)
                    for x in (2, 4)]
                   + [dict(d=d, g=sg["g"], dtype=dt, k=sg["k"], x=2)
                      for d, dt in ((128, "fp32"), (128, "fp8e4"), (64, "bf16"))])
        # the keys from their 4-bit codes (`ops.key_codes`), in both grids: X = 2 and 4, G 1 / 4 / 7, D 64 / 128
        + [dict(d=d, g=g, dtype="bf16", k=sg["k"], x=x, anchors=SERVED_ANCHORS, codes=True) for d in HEAD_DIMS
           for g in (1, sg["g"], 7) for x in (2, 4)]
        # the second level leaving its top-K to the attend (LaunchOptions.rank_in_attend, the CUDA default): its
        # log-sum-exps only, split (batch 1) and one program a row (batch 16), exact keys and 4-bit codes
        + [dict(d=sg["d"], g=g, dtype=dt, k=sg["k"], x=x, bs=bs, lse_only=True, **c) for g in (1, sg["g"], 7)
           for x in (2, 4) for bs in (1, 16) for dt, c in (("bf16", {}), ("bf16", dict(codes=True)), ("fp8e4", {}))
           if g == sg["g"] or (dt == "bf16" and not c and bs == 1)],
        # 4-bit key codes of complete blocks (a cheaper second level's keys): every dim and K/V dtype, fp8 included.
        "key_codes": product(d=HEAD_DIMS, dtype=("bf16", "fp16", "fp32") + SERVED_FP8, h_kv=(8,)),
        "gated_attention": [p for p in product(d=HEAD_DIMS, g=GROUPS, dtype=DTYPES)
                            if grid == "full" or p["dtype"] in CI_HALF_TRAINING
                            or (p["dtype"] == "fp32" and all(p[k] == v for k, v in CI_FP32_TRAINING.items()))],
    }
    # The launch variants the GPU measurement decides (ops.fused_step.LaunchOptions), at the spec geometry in
    # both grids: PDL (grid dependency control compiled in) and 8 warps for select and attend (the benchmark's
    # VARIANTS; the front at 2 warps spilled 8 bytes at 255 registers, so it is not a variant).
    spec_front = dict(d=sg["d"], dg=sg["dg"], g=sg["g"], dtype="bf16", weights="bf16", summaries="bf16")
    spec_select = dict(dg=sg["dg"], k=sg["k"], anchors=4, sink=1, local=1, bs=1, h_kv=8, m=4096)
    spec_attend = dict(d=sg["d"], g=sg["g"], dtype="bf16", k=sg["k"])
    out["decode_front"].append(dict(spec_front, pdl=True))
    for op, base in (("decode_select", spec_select), ("decode_attend", spec_attend)):
        out[op] += [dict(base, pdl=True), dict(base, warps=8)]
    for op, ps in served_cases().items():  # what the CUDA path launches, in both grids
        out[op] += ps
    # BASE's runtime ints where a case leaves them out, in a fixed key order for the labels.
    return {op: [{**{k: BASE[k] for k in RUNTIME_KEYS[op]}, **p} for p in ps] for op, ps in out.items()}


# What the CUDA path launches (issue 64 item 4): the fused step at Qwen3-4B's geometry as `DecodeStep` runs it on a
# GPU (ops.fused_step.default_sizes(cuda=True): the front's QCHUNK / KCHUNK, the attend splits), with the shipped
# default (bf16 summaries, bf16 gate weights, the Qwen gate's 4 prompt anchors) and fp32, every budget, every batch
# size up to the fused workspace's rows and every width up to 256K tokens (an eager step's width is its longest
# request's, a captured one's the server's: SGLang's context_length + 4), and the benchmark's variants (select chunk,
# programs, warps, PDL). A configuration is what decides the machine code's registers and spills: the kernel, its
# declared constexprs, its pointer dtypes and its options (num_warps, PDL) - not the "== 1" / "% 16"
# specializations of runtime ints (widths, strides), which vary with every width and change no tile. Each axis is
# reduced to one value per configuration (`config_key`); tests/test_triton_sm90_compile.py::
# test_every_configuration_the_cuda_path_launches_is_compiled records the launches densely and fails on a
# configuration the CI grid never compiles.
SERVED_ROWS = 256  # sas_backend.backend.decode_step.FUSED_MAX_ROWS (not imported: that module imports SGLang-side code)
SERVED_MAX_BLOCKS = 262144 // BLOCK + 1
SERVED_FORCED = (1, 1)  # sink and local blocks of the shipped gates
SERVED_ANCHORS = 4  # the Qwen gate's serve default (0 is compiled by the spec sweep above)
SERVED_DTYPES = ("bf16", "fp32")  # summaries and gate weights together: the CUDA default, then fp32
SERVED_CHUNKS = (64, 256)  # bench_decode_step.VARIANTS' select chunks (beside each K's default)
SERVED_PROGRAMS = (132, 528)  # and programs per launch (beside GPU_TARGET_PROGRAMS)
# Sub-block summaries (--sas-sub-blocks, issue 63): the fused front and select take a SUB constexpr, the per-op path
# scores with it and summarizes runs of BLOCK / SUB tokens; compiled at the serve default budget 2048 (the one they were
# measured at) with the default select chunk and split sizes (other budgets compile on the GPU when first launched).
SERVED_SUB_BLOCKS = (4,)
# An fp8 KV cache (--kv-cache-dtype, issue 66): the front and attend read fp8 K / V (bf16 queries), compiled at the
# serve default budget (every attend split class; the front with the CUDA default's bf16 summaries and gate weights)
# as the sub-blocks are; fp32 summaries over fp8 KV compile on the GPU when first launched.
SERVED_FP8 = ("fp8e4", "fp8e5")


def served_cases() -> dict[str, list[dict]]:
    """{op: [params]} of the fused step's launches on the CUDA path, one per configuration (see above): select per
    (merge tile, warps) of the widths 1 .. 256K tokens (a multiple of 16 blocks where the class has one, as the
    server's width is), attend per (splits padded to a power of two) of the batch sizes 1 .. SERVED_ROWS."""
    from sas_backend.ops import fused_step as fused

    sg = SPEC_GEOMETRY
    spec = dict(h_kv=8, d=sg["d"], dg=sg["dg"], g=sg["g"])
    out = {"decode_front": [dict(spec, bs=bs, dtype="bf16", weights=dt, summaries=dt, pdl=pdl, **sub, **kv)
                            for dt in SERVED_DTYPES for pdl in (False, True) for bs in (1, 8)
                            for sub in [{}] + [dict(sub=n) for n in SERVED_SUB_BLOCKS]
                            for kv in [{}] + [dict(kv=x) for x in SERVED_FP8 if dt == "bf16"]]
           # --sas-rerank-keys int4: the front also writes the completed block's 4-bit key codes
           + [dict(spec, bs=bs, dtype="bf16", weights=dt, summaries=dt, pdl=pdl, codes=True, **sub)
              for dt in SERVED_DTYPES for pdl in (False, True) for bs in (1, 8)
              for sub in [{}] + [dict(sub=n) for n in SERVED_SUB_BLOCKS]],
           "decode_select": [], "decode_attend": []}

    def workspace(k, **kw):
        geo = fused.StepGeometry(8, sg["g"], sg["d"], sg["d"], sg["dg"], k, BLOCK)
        return fused.DecodeStepWorkspace(geo, 1, 1, "cpu", **{**fused.default_sizes(cuda=True), **kw})

    for k in [b // BLOCK for b in BUDGETS]:
        variants = [{}] + ([dict(chunk=c) for c in SERVED_CHUNKS] if k == sg["k"] else [])
        for v in variants + ([dict(sub=n) for n in SERVED_SUB_BLOCKS] if k == sg["k"] else []):
            ws, widths = workspace(k, **{n: x for n, x in v.items() if n != "sub"}), {}
            for m in range(1, SERVED_MAX_BLOCKS + 1):
                cls = (ws.merge_tile(m), ws.select_warps(m))
                if cls not in widths or (m % 16 == 0 and widths[cls] % 16):
                    widths[cls] = m
            dtypes = SERVED_DTYPES if k == sg["k"] and set(v) <= {"sub"} else SERVED_DTYPES[:1]
            out["decode_select"] += [dict(h_kv=8, dg=sg["dg"], k=k, bs=1, m=m, anchors=SERVED_ANCHORS, summaries=dt,
                                          sink=SERVED_FORCED[0], local=SERVED_FORCED[1], **v)
                                     for m in widths.values() for dt in dtypes]
        for v in [{}] + ([dict(programs=p) for p in SERVED_PROGRAMS] + [dict(kv=x) for x in SERVED_FP8]
                         if k == sg["k"] else []):
            ws, seen = workspace(k, **{"target_programs": v["programs"]} if "programs" in v else {}), set()
            for bs in range(1, SERVED_ROWS + 1):
                splits = ws.attend_splits(bs)
                cls = (max(2, 1 << max(0, splits - 1).bit_length()), splits == 1)  # attend's SPLITS_P, ONE_SPLIT
                if cls not in seen:
                    seen.add(cls)
                    out["decode_attend"].append(dict(spec, bs=bs, dtype="bf16", k=k, **v))
                    # two levels at the serve default budget (--sas-exact-rerank 2 and 4): the attend ranks
                    if k == sg["k"] and not v:
                        out["decode_attend"] += [dict(spec, bs=bs, dtype="bf16", k=k, x=x) for x in (2, 4)]
                    if k == sg["k"] and "kv" in v:
                        out["decode_attend"].append(dict(spec, bs=bs, dtype="bf16", k=k, x=2, **v))
    return out


def config_key(fn, signature: dict, constexprs: dict, options) -> str:
    """What decides a launch's machine code beyond the int specializations (see served_cases): the kernel, its
    declared constexprs by name, its pointer and float argument types, and its options."""
    names = {p.num: p.name for p in fn.params if p.is_constexpr}
    declared = sorted((names[k[0]], repr(v)) for k, v in constexprs.items() if k and k[0] in names)
    types = sorted((n, t) for n, t in signature.items() if isinstance(t, str) and (t.startswith("*") or "fp" in t))
    return json.dumps([_kernel_id(fn), declared, types, sorted((k, repr(v)) for k, v in vars(options).items())])


# ----------------------------------------------------------------------------------- launches
def _dt(name: str):
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp8e4": torch.float8_e4m3fn,
            "fp8e5": torch.float8_e5m2}[name]


def launch(op: str, p: dict, sizes: dict | None = None) -> None:
    """Call the op's Triton launcher once with the server's (or trainer's) argument layout. sizes: the fused step's
    workspace split sizes (default: a CUDA workspace's, `ops.fused_step.default_sizes(cuda=True)`)."""
    import torch

    f32, i64, i32 = torch.float32, torch.int64, torch.int32
    bs, h_kv, m = (p.get(k, BASE[k]) for k in ("bs", "h_kv", "m"))
    pages = 65  # a small pool: the slot count changes no stride or constexpr
    # Decode-step tensors as SGLang and sas_backend hold them: seq_lens / candidates int64,
    # block table int64 [bs, M + 1], fp32 RoPE rows and gate weights, KV in the model dtype.
    seq_lens = torch.full((bs,), m * BLOCK + 1, dtype=i64)
    table = torch.zeros(bs, m + 1, dtype=i64)
    if op == "gate_query":
        from sas_backend.ops.gate.triton import gate_query_triton

        d, dg, g = p["d"], p["dg"], p["g"]
        gate_query_triton(torch.empty(bs, h_kv * g, d, dtype=_dt(p["dtype"])), torch.ones(bs, d),
                          torch.empty(h_kv, g, d, dg), torch.empty(dg), torch.empty(bs, dg),
                          out=torch.empty(bs, h_kv, dg), split=p["split"])
    elif op in ("summarize_pages", "summary_update", "summarize_listed"):
        from sas_backend.ops.summary import triton as st

        d, dg = p["d"], p["dg"]
        k_buffer = torch.empty(pages * BLOCK, h_kv, d, dtype=_dt(p.get("kv", p["dtype"])))
        model_t, gate_t = torch.ones(4 * BLOCK, d), torch.ones(4 * BLOCK, dg)
        w_k, k_norm = torch.empty(h_kv, 3 * d, dg), torch.empty(dg)
        if op == "summarize_pages":
            n = p["n"]
            st.summarize_pages_triton(k_buffer, torch.zeros(n, dtype=i64), torch.zeros(n, dtype=i64),
                                      model_t, gate_t, w_k, k_norm, BLOCK // p.get("sub", 1))
        elif op == "summarize_listed":  # the step's late-block list: bs x M entries and the count, on the device
            sub = p.get("sub", 1)
            summaries = torch.empty(pages + 1, h_kv, sub * dg, dtype=_dt(p["summaries"]))
            listed = torch.zeros(bs * m + 1, dtype=i64)
            st.summarize_listed_triton(k_buffer, summaries, listed, listed, torch.zeros(1, dtype=i64), BLOCK,
                                       model_t, gate_t, w_k, k_norm, sub_blocks=sub, programs=max(1, 264 // h_kv))
        else:
            summaries = torch.empty(pages + 1, h_kv, dg, dtype=_dt(p["summaries"]))
            st.summary_update_decode_triton(k_buffer, summaries, table, seq_lens, BLOCK, model_t, gate_t,
                                            w_k, k_norm)
    elif op == "late_blocks":
        from sas_backend.ops.late_blocks.triton import list_late_blocks_triton

        listed = torch.zeros(bs * m + 1, dtype=i64)
        list_late_blocks_triton(table, torch.full((bs,), m, dtype=i64), seq_lens, torch.zeros(pages, dtype=torch.bool),
                                BLOCK, listed, listed, torch.zeros(1, dtype=i64), torch.zeros((), dtype=torch.bool),
                                torch.zeros(1, dtype=i64))
    elif op == "score":
        from sas_backend.ops.score.triton import score_blocks_triton

        dg = p["dg"]
        sub = p.get("sub", 1)
        score_blocks_triton(torch.empty(bs, h_kv, dg, dtype=_dt(p["gate_q"])),
                            torch.empty(pages + 1, h_kv, sub * dg, dtype=_dt(p["summaries"])), table,
                            torch.full((bs,), m, dtype=i64), BLOCK, m, sub_blocks=sub)
    elif op == "topk":
        from sas_backend.ops.topk.triton import select_blocks_triton

        select_blocks_triton(torch.empty(bs, h_kv, m, dtype=f32), torch.full((bs,), m, dtype=i64), p["k"],
                             p["sink"], p["local"])
    elif op == "gather":
        from sas_backend.ops.gather.triton import build_kv_indices_triton

        k = p["k"]
        rows = bs * h_kv
        indptr = torch.arange(rows + 1, dtype=i32) * ((k + 1) * BLOCK)
        build_kv_indices_triton(torch.zeros(bs, h_kv, k, dtype=i32), table, seq_lens, BLOCK, indptr,
                                torch.empty(rows * (k + 1) * BLOCK, dtype=i32))
    elif op.startswith("decode_"):
        from sas_backend.ops import fused_step as fused

        d, dg, g = p.get("d", 128), p.get("dg", 128), p.get("g", 4)
        k = p.get("k", 32)
        sub = p.get("sub", 1)
        geo = fused.StepGeometry(h_kv, g, d, d, dg, k, BLOCK, sub)
        warps = {f"{op[len('decode_'):]}_warps": p["warps"]} if "warps" in p else {}
        # The GPU's split sizes (front units, attend splits), as a CUDA workspace takes them: the CPU defaults would
        # compile the front with one unit per head (QCHUNK = KCHUNK = D/2), a kernel no GPU launches.
        sizes = {**(sizes or fused.default_sizes(cuda=True)),
                 **({"target_programs": p["programs"]} if "programs" in p else {})}
        ws = fused.DecodeStepWorkspace(geo, bs, m, "cpu", chunk=p.get("chunk"), **sizes,
                                       launch=fused.LaunchOptions(pdl=p.get("pdl", False), **warps))
        dt = _dt(p.get("dtype", "bf16"))
        k_buffer = torch.empty(pages * BLOCK, h_kv, d, dtype=_dt(p.get("kv", p.get("dtype", "bf16"))))
        summaries = torch.empty(pages + 1, h_kv, sub * dg, dtype=_dt(p.get("summaries", "fp32")))
        if op == "decode_front":
            wt = _dt(p["weights"])
            codes = (torch.empty(pages + 1, h_kv, BLOCK * d // 2, dtype=torch.uint8),
                     torch.empty(pages + 1, h_kv, 2, d, dtype=torch.float16)) if p.get("codes") else None
            fused.front(ws, torch.empty(bs, h_kv * g, d, dtype=dt), torch.ones(bs, d), torch.ones(bs, dg),
                        torch.empty(h_kv, g, d, dg, dtype=wt), torch.empty(dg), k_buffer, torch.ones(4 * BLOCK, d),
                        torch.ones(4 * BLOCK, dg), torch.empty(h_kv, 3 * d, dg, dtype=wt), torch.empty(dg),
                        summaries, table, seq_lens, key_codes=codes)
        elif op == "decode_select":
            anchors = torch.full((bs, h_kv, p["anchors"]), -1, dtype=i32) if p["anchors"] else None
            fused.select(ws, torch.empty(bs, h_kv, dg), summaries, table, torch.full((bs,), m, dtype=i64), m,
                         p.get("sink", 0), p.get("local", 0), anchors)
        else:
            rank = None
            if p.get("x"):  # two levels, the attend ranking the second level's log-sum-exps (ops.rerank.candidate_lse)
                from sas_backend.ops.rerank import CandidateLse, RerankWorkspace

                c = k * p["x"]
                rws = RerankWorkspace(bs, h_kv, g, c, "cpu", ranked_rows=bs)
                anchors = torch.full((bs + 3, h_kv, SERVED_ANCHORS), -1, dtype=i32)
                rank = CandidateLse(rws.lse, rws.cp, rws.gp, torch.zeros(bs, h_kv, c, dtype=i32),
                                    torch.full((bs,), m, dtype=i64), *SERVED_FORCED, anchors,
                                    torch.zeros(bs, dtype=i64))
            fused.attend(ws, torch.empty(bs, h_kv * g, d, dtype=dt), k_buffer, torch.empty_like(k_buffer),
                         torch.zeros(bs, h_kv, k, dtype=i32), table, seq_lens, d**-0.5, rank=rank)
    elif op == "rerank":
        from sas_backend.ops.rerank import RerankWorkspace
        from sas_backend.ops.rerank.triton import rerank_blocks_triton

        d, g, k, c = p["d"], p["g"], p["k"], p["k"] * p["x"]
        kv = p["dtype"] if p["dtype"].startswith("fp8") else None
        q = torch.empty(bs, h_kv * g, d, dtype=_dt("bf16" if kv else p["dtype"]))
        k_buffer = torch.empty(pages * BLOCK, h_kv, d, dtype=_dt(kv or p["dtype"]))
        anchors = torch.full((bs + 3, h_kv, p["anchors"]), -1, dtype=i32) if p.get("anchors") else None
        codes = (torch.empty(pages, h_kv, BLOCK * d // 2, dtype=torch.uint8),
                 torch.empty(pages, h_kv, 2, d, dtype=torch.float16)) if p.get("codes") else None
        first = torch.zeros(bs, h_kv, c, dtype=i32)
        if p.get("lse_only"):  # the second level whose top-K the attend takes (ops.rerank.candidate_lse)
            from sas_backend.ops.rerank.triton import candidate_lse_triton

            candidate_lse_triton(q, k_buffer, first, table, d**-0.5, BLOCK, 1.0,
                                 RerankWorkspace(bs, h_kv, g, c, "cpu", ranked_rows=bs), key_codes=codes)
        else:
            rerank_blocks_triton(q, k_buffer, first, table, torch.full((bs,), m, dtype=i64), k, d**-0.5, BLOCK,
                                 *SERVED_FORCED, anchors, torch.zeros(bs, dtype=i64) if anchors is not None else None,
                                 1.0, RerankWorkspace(bs, h_kv, g, c, "cpu"), key_codes=codes)
    elif op == "key_codes":
        from sas_backend.ops.key_codes.triton import encode_pages_triton

        d = p["d"]
        encode_pages_triton(torch.empty(pages * BLOCK, h_kv, d, dtype=_dt(p["dtype"])), torch.zeros(4, dtype=i64),
                            BLOCK, torch.empty(pages, h_kv, BLOCK * d // 2, dtype=torch.uint8),
                            torch.empty(pages, h_kv, 2, d, dtype=torch.float16), 1.0)
    elif op == "gated_attention":
        from sas_backend.training.ops.gated_attention import gated_attention

        # A packed training batch: 2 rows of 512 tokens, fp32 gates (the gate's log-softmax).
        d, g, hk, t = p["d"], p["g"], 2, 1024
        dt = _dt(p["dtype"])
        q = torch.zeros(t, hk * g, d, dtype=dt, requires_grad=True)
        kv = [torch.zeros(t, hk, d, dtype=dt, requires_grad=True) for _ in range(2)]
        log_g = torch.zeros(hk, t, 512 // BLOCK, requires_grad=True)
        cu = torch.tensor([0, 512, t], dtype=i32)
        o = gated_attention(q, kv[0], kv[1], log_g, torch.zeros(hk, t), cu, BLOCK)
        o.backward(torch.zeros_like(o))  # records the delta, dQ and dK/dV kernels
    else:
        raise ValueError(f"unknown op {op}")


# ----------------------------------------------------------------------------------- recording
def _target():
    from triton.backends.compiler import GPUTarget

    return GPUTarget("cuda", 90, 32)


@contextlib.contextmanager
def recording(into: list):
    """Replace JITFunction.run by a recorder: bind like a real launch, compile and launch nothing."""
    from triton import knobs
    from triton.compiler import make_backend
    from triton.runtime import jit

    backend = make_backend(_target())
    binders = {}

    def run(self, *args, grid, warmup, **kwargs):
        # The same option defaults JITFunction.run adds before binding (those this version has).
        kwargs["debug"] = kwargs.get("debug", self.debug) or knobs.runtime.debug
        for name in ("instrumentation_mode", "fpsan_homomorphic_casts"):
            if hasattr(knobs.compilation, name):
                kwargs[name] = getattr(knobs.compilation, name)
        if self not in binders:
            binders[self] = jit.create_function_from_signature(self.signature, self.params, backend)
        bound, spec, options = binders[self](*args, **kwargs)
        options, signature, constexprs, attrs = self._pack_args(backend, kwargs, bound, spec, options)
        into.append((self, signature, constexprs, attrs, options))
        return None

    saved = jit.JITFunction.run
    jit.JITFunction.run = run
    try:
        yield
    finally:
        jit.JITFunction.run = saved


def record_all(grid: str = "full") -> tuple[list, int]:
    """The distinct compile keys over every case of every op (each with the cases behind it), and
    the number of recorded launches. Two launches share a key exactly when a real launch would
    reuse the compiled kernel: same signature, constexprs, attributes and options."""
    variants, n = {}, 0
    for op, params in cases(grid).items():
        for p in params:
            calls = []
            with recording(calls):
                launch(op, p)
            if not calls:
                raise RuntimeError(f"{op} {p}: the launcher launched nothing")
            for fn, signature, constexprs, attrs, options in calls:
                n += 1
                key = json.dumps([_kernel_id(fn), signature, sorted((str(k), repr(v)) for k, v in constexprs.items()),
                                  sorted((str(k), repr(v)) for k, v in attrs.items()),
                                  sorted((k, repr(v)) for k, v in vars(options).items())])
                v = variants.setdefault(key, dict(fn=fn, signature=signature, constexprs=constexprs,
                                                  attrs=attrs, options=options, op=op, cases=[]))
                v["cases"].append(p)
    out = list(variants.values())
    return (out if grid == "full" else one_per_configuration(out)), n


def one_per_configuration(variants: list) -> list:
    """The CI grid's variants: one per op and configuration (`config_key`: kernel, constexprs, pointer and float
    types, options), the one with the most divisibility-by-16 attributes (a GPU server pads its widths to 16),
    carrying the cases of the others. The variants dropped differ only in the "== 1" / "% 16" specializations of
    runtime ints, which change no tile (see served_cases); the full grid compiles each (about 50 of 345 CPU s)."""
    def divisible(v):
        return sum(any(x and x[0] == "tt.divisibility" for x in a) for a in v["attrs"].values())

    kept = {}
    for v in variants:
        key = (v["op"], config_key(v["fn"], v["signature"], v["constexprs"], v["options"]))  # cases stay with their op
        k = kept.get(key)
        if k is None:
            kept[key] = v
            continue
        keep, drop = (v, k) if divisible(v) > divisible(k) else (k, v)
        keep["cases"] = keep["cases"] + [c for c in drop["cases"] if c not in keep["cases"]]
        kept[key] = keep
    return list(kept.values())


# ----------------------------------------------------------------------------------- compiling
_PTXAS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")


def _cpu_seconds() -> float:
    """CPU time of this process and its finished children (ptxas): a load-independent cost."""
    import resource

    a, b = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime


def compile_variant(v: dict) -> dict:
    """Compile one variant for sm_90 with an empty cache; registers, spills and static shared
    memory from ptxas's -v log (Triton's own ptxas run, printed by its dump_ptxas_log knob)."""
    import triton
    from triton import knobs
    from triton.compiler import ASTSource

    c0 = _cpu_seconds()
    log = io.StringIO()
    res = dict(error=None)
    try:
        knobs.nvidia.dump_ptxas_log = True
        with contextlib.redirect_stdout(log):
            k = triton.compile(ASTSource(v["fn"], v["signature"], v["constexprs"], v["attrs"]), target=_target(),
                               options=vars(v["options"]))
        md = k.metadata
        res.update(num_warps=md.num_warps, num_stages=md.num_stages, shared=md.shared,
                   # programmatic dependent launch: the grid dependency control instructions in the PTX
                   griddepcontrol=k.asm["ptx"].count("griddepcontrol."))
    except Exception as e:  # noqa: BLE001 - any failure to compile is the finding
        res["error"] = f"{type(e).__name__}: {e}"[:4000]
    text = log.getvalue()
    regs, props = _REGS.findall(text), _PTXAS.findall(text)
    if res["error"] is None:
        if len(regs) != 1 or len(props) != 1:  # one entry function per module, no callees
            res["error"] = f"expected one ptxas -v report, got {len(regs)}: {text[-1000:]}"
        else:
            res.update(registers=int(regs[0]), stack_frame=int(props[0][0]), spill_stores=int(props[0][1]),
                       spill_loads=int(props[0][2]), static_smem=int((_SMEM.findall(text) or [0])[-1]))
    res["cpu_seconds"] = round(_cpu_seconds() - c0, 2)
    return res


_VARIANTS: list = []  # set before forking the compile workers (they index into it)


def _compile_index(i: int) -> tuple[int, dict]:
    return i, compile_variant(_VARIANTS[i])


def compile_all(variants: list, jobs: int) -> list:
    """Results in the order of `variants`, over `jobs` forked processes (progress on stderr)."""
    global _VARIANTS
    _VARIANTS = variants
    # Training kernels first: they take longest, so the workers finish together.
    order = sorted(range(len(variants)), key=lambda i: not _is_training(variants[i]["fn"]))
    done = {}
    if jobs <= 1:
        results = map(_compile_index, order)
        pool = None
    else:
        import multiprocessing

        pool = multiprocessing.get_context("fork").Pool(jobs)
        results = pool.imap_unordered(_compile_index, order, chunksize=1)
    try:
        for i, r in results:
            done[i] = r
            if len(done) % 25 == 0 or len(done) == len(variants):
                print(f"[compile_triton] {len(done)}/{len(variants)} compiled", file=sys.stderr, flush=True)
    finally:
        if pool is not None:
            pool.close()
            pool.join()
    return [done[i] for i in range(len(variants))]


# ----------------------------------------------------------------------------------- coverage
def package_jit_functions() -> dict:
    """{kernel id: JITFunction} of every @triton.jit function in KERNEL_MODULES and in any module
    under sas_backend whose source mentions triton.jit (so a new kernel module is seen too)."""
    from triton.runtime.jit import JITFunction

    names = set(KERNEL_MODULES)
    for path in (REPO / "sas_backend").rglob("*.py"):
        if "triton.jit" in path.read_text():
            names.add(".".join(path.relative_to(REPO).with_suffix("").parts))
    found = {}
    for mod_name in sorted(names):
        mod = importlib.import_module(mod_name)
        for attr, obj in vars(mod).items():
            if isinstance(obj, JITFunction) and obj.__module__ == mod_name:
                found[f"{mod_name}.{attr}"] = obj
            elif type(obj).__name__ in ("Autotuner", "Heuristics"):  # configs are not recorded
                found[f"{mod_name}.{attr} (autotuned: record every config)"] = None
    return found


def coverage(compiled_kernels: set) -> dict:
    """Which package @triton.jit functions were compiled as kernels, which only inside a compiled
    one (a callee named in its source, transitively), and which not at all."""
    funcs = package_jit_functions()
    live = {n: f for n, f in funcs.items() if f is not None}
    reached = set(compiled_kernels) & set(live)
    frontier = list(reached)
    while frontier:
        name = frontier.pop()
        src = inspect.getsource(live[name].fn)
        mod = name.rsplit(".", 1)[0]
        for other, f in live.items():
            if other not in reached and other.rsplit(".", 1)[0] == mod and \
                    re.search(rf"\b{re.escape(f.fn.__name__)}\s*\(", src):
                reached.add(other)
                frontier.append(other)
    return dict(kernels=sorted(compiled_kernels), callees=sorted(reached - set(compiled_kernels)),
                uncovered=sorted(set(funcs) - reached))


# ----------------------------------------------------------------------------------- checks
def _kernel_id(fn) -> str:
    return f"{fn.__module__}.{fn.__name__}"


def _is_training(fn) -> bool:
    return fn.__module__.startswith(TRAINING_MODULES)


def _short(kid: str) -> str:
    return kid.replace("sas_backend.", "").replace(".triton.", ".").replace("training.ops.gated_attention.",
                                                                             "training.")


def _geometry(cs: list) -> str:
    """Compact union of the cases' parameters, e.g. 'bs=8 h_kv=8 d=128 dg=64,128 g=2,3,4,7,8'."""
    parts = []
    for k in cs[0]:
        vals = sorted({c[k] for c in cs}, key=lambda x: (str(type(x)), x))
        parts.append(f"{k}={','.join(map(str, vals))}")
    return " ".join(parts)


def variant_row(v: dict, r: dict) -> dict:
    """One table row: what was compiled (kernel, cases, constexprs, specialization) and its result."""
    fn, params = v["fn"], v["fn"].params
    declared = {p.name for p in params if p.is_constexpr}
    named = {params[k[0]].name: c for k, c in v["constexprs"].items()}
    return dict(
        kernel=_short(_kernel_id(fn)), kernel_id=_kernel_id(fn), kind="training" if _is_training(fn) else "serving",
        op=v["op"],
        geometry=_geometry(v["cases"]), cases=v["cases"],
        constexprs={k: c if isinstance(c, (int, float, str, bool)) else repr(c) for k, c in named.items()
                    if k in declared},
        ones=[k for k in named if k not in declared],  # runtime ints Triton specialized to 1
        signature={k: s for k, s in v["signature"].items() if s != "constexpr"},
        divisible_16=[params[k[0]].name for k, a in v["attrs"].items() if any(x and x[0] == "tt.divisibility"
                                                                               for x in a)],
        **r)


def check(rows: list, cov: dict) -> tuple[list, list]:
    """(failures, notes). Failures: compile errors, shared memory over the H100 limit, spills in
    serving kernels (and in training ones when TRAINING_SPILLS_FAIL), uncovered @triton.jit
    functions. Notes: training spills otherwise, shared memory within 5% of the limit."""
    failures, notes = [], []
    for row in rows:
        tag = f"{row['kernel']} [{row['geometry']}]"
        if row["error"]:
            lines = [x.strip() for x in row["error"].splitlines() if x.strip()]
            failures.append(f"compile error: {tag}: {lines[0][:200]}"
                            f"{' ... ' + lines[-1][:300] if len(lines) > 1 else ''}")
            continue
        smem = row["shared"] + row["static_smem"]
        if smem > SMEM_LIMIT:
            failures.append(f"shared memory {smem} B > {SMEM_LIMIT} B: {tag}")
        elif smem > 0.95 * SMEM_LIMIT:
            notes.append(f"shared memory {smem} B, within 5% of the {SMEM_LIMIT} B limit: {tag}")
        pdl = row["constexprs"].get("PDL")
        if pdl is not None and bool(row.get("griddepcontrol")) != bool(pdl):
            failures.append(f"PDL={pdl} but {row.get('griddepcontrol', 0)} griddepcontrol instructions in the PTX: "
                            f"{tag}")
        if row["spill_stores"] or row["spill_loads"]:
            msg = f"register spill ({row['spill_stores']} B stores, {row['spill_loads']} B loads, " \
                  f"{row['registers']} registers): {tag}"
            (failures if row["kind"] == "serving" or TRAINING_SPILLS_FAIL else notes).append(msg)
    failures += [f"not compiled by any recorded launch: {u}" for u in cov["uncovered"]]
    return failures, notes


def per_kernel(rows: list) -> dict:
    """Per kernel: variants, errors, warps/stages used, max registers / spill bytes / shared memory."""
    kernels = {}
    for row in rows:
        s = kernels.setdefault(row["kernel"], dict(kind=row["kind"], variants=0, errors=0, num_warps=[],
                                                   num_stages=[], max_registers=0, spilling_variants=0,
                                                   max_spill_bytes=0, max_shared=0, cpu_seconds=0.0))
        s["variants"] += 1
        s["cpu_seconds"] = round(s["cpu_seconds"] + row["cpu_seconds"], 2)
        if row["error"]:
            s["errors"] += 1
            continue
        spill = row["spill_stores"] + row["spill_loads"]
        s["max_registers"] = max(s["max_registers"], row["registers"])
        s["spilling_variants"] += bool(spill)
        s["max_spill_bytes"] = max(s["max_spill_bytes"], spill)
        s["max_shared"] = max(s["max_shared"], row["shared"] + row["static_smem"])
        s["num_warps"] = sorted({*s["num_warps"], row["num_warps"]})
        s["num_stages"] = sorted({*s["num_stages"], row["num_stages"]})
    return kernels


# ----------------------------------------------------------------------------------- report
def build_record(rows: list, n_launches: int, grid: str, seconds: dict, jobs: int) -> dict:
    """The JSON record: environment, checks, per-kernel summary, one row per compiled variant."""
    import torch
    import triton

    from sas_backend.testing.report import git_commit

    cov = coverage({r["kernel_id"] for r in rows})
    failures, notes = check(rows, cov)
    return dict(
        question="Does every Triton kernel of sas_backend compile for sm_90 (H100) at the README's geometries, "
                 "within the H100's shared memory and (serving kernels) without register spills?",
        ok=not failures, failures=failures, notes=notes,
        triton=triton.__version__, ptxas=_ptxas_version(), torch=torch.__version__,
        python=platform.python_version(), machine=f"{platform.machine()}, {os.cpu_count()} CPUs, no GPU",
        target="cuda capability 90 (sm_90a), warp 32", commit=git_commit(), grid=grid,
        limits=dict(shared_bytes=SMEM_LIMIT, serving_spills="fail",
                    training_spills="fail" if TRAINING_SPILLS_FAIL else "report"),
        axes=dict(head_dims=HEAD_DIMS, gate_dims=GATE_DIMS, groups=GROUPS, dtypes=DTYPES, budgets=BUDGETS,
                  block=BLOCK, widths=WIDTHS, base_runtime_ints=BASE, spec_geometry=SPEC_GEOMETRY,
                  spec_batch=SPEC_BATCH, spec_kv_heads=SPEC_KV_HEADS, spec_pages=SPEC_PAGES,
                  spec_widths=SPEC_WIDTHS, spec_forced=SPEC_FORCED,
                  ci_fp32_training=CI_FP32_TRAINING if grid == "ci" else "all",
                  ci_half_training=CI_HALF_TRAINING if grid == "ci" else "all"),
        launches_recorded=n_launches, variants_compiled=len(rows), jobs=jobs, seconds=seconds,
        coverage=cov, kernels=per_kernel(rows), variants=rows,
    )


def _ptxas_version() -> str:
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        p = get_ptxas(_target().arch) if "arch" in inspect.signature(get_ptxas).parameters else get_ptxas()
        out = subprocess.run([p.path, "--version"], capture_output=True, text=True, timeout=30).stdout
        return out.strip().splitlines()[-1]
    except Exception as e:  # noqa: BLE001 - informational only
        return f"unknown ({type(e).__name__})"


def dump_json(rec: dict) -> str:
    """The record as JSON, indented, with one line per variant (diffable, a third smaller)."""
    head = json.dumps({k: v for k, v in rec.items() if k != "variants"}, indent=1)
    rows = ",\n".join("  " + json.dumps(r) for r in rec["variants"])
    return f'{head[:-2]},\n "variants": [\n{rows}\n ]\n}}\n'


def markdown(rec: dict) -> str:
    """The record as Markdown: verdict, per-kernel summary, then one row per compiled variant."""
    c = rec["commit"]
    lines = [f"# Triton {rec['triton']} -> sm_90 (H100): {'PASS' if rec['ok'] else 'FAIL'}", "",
             f"{rec['variants_compiled']} distinct compiled variants from {rec['launches_recorded']} recorded "
             f"launches (grid `{rec['grid']}`); ptxas `{rec['ptxas']}`; torch {rec['torch']}, Python {rec['python']}; "
             f"{rec['machine']}; commit {c.get('commit')}{' (dirty)' if c.get('dirty') else ''}. "
             f"CPU time: record {rec['seconds']['record']} s, compile {rec['seconds']['compile_cpu']} s "
             f"({rec['seconds']['compile_wall']} s wall over {rec['jobs']} processes).", "",
             f"Checks: compile errors, shared memory <= {rec['limits']['shared_bytes']} B per block, register "
             f"spills in serving kernels (fail); spills in training kernels: {rec['limits']['training_spills']}; "
             f"every @triton.jit function of the package compiled.", ""]
    if rec["failures"]:
        lines += ["## Failures", ""] + [f"- {f}" for f in rec["failures"]] + [""]
    if rec["notes"]:
        lines += ["## Notes (not failures)", ""] + [f"- {f}" for f in rec["notes"]] + [""]
    lines += ["## Per kernel", "",
              "| kernel | kind | variants | errors | warps | stages | max regs | spilling variants | max spill B "
              "(st+ld) | max smem B | CPU s |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, s in rec["kernels"].items():
        lines.append(f"| {name} | {s['kind']} | {s['variants']} | {s['errors']} | "
                     f"{'/'.join(map(str, s['num_warps']))} | {'/'.join(map(str, s['num_stages']))} | "
                     f"{s['max_registers']} | {s['spilling_variants']} | {s['max_spill_bytes']} | {s['max_shared']} | "
                     f"{s['cpu_seconds']} |")
    cov = rec["coverage"]
    lines += ["", f"Coverage: {len(cov['kernels'])} kernels compiled, {len(cov['callees'])} helper functions "
              f"compiled inside them; uncovered: {', '.join(cov['uncovered']) or 'none'}.", "",
              "## Variants", "",
              "Geometry: every value of the cases behind the variant (bs batch, h_kv kv heads, m max blocks, "
              "n pages, sink/local forced blocks, k blocks of the budget, d head dim, dg gate dim, "
              "g = H_q / H_kv, dtype of q/KV, gate_q/summaries dtypes); the JSON lists each case. "
              "'= 1': runtime ints Triton specialized to the constant 1. smem: Triton's dynamic + static.", "",
              "| kernel | geometry | constexprs | = 1 | warps/stages | regs | spill st/ld B | smem B | CPU s |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rec["variants"]:
        cx = " ".join(f"{k}={v}" for k, v in r["constexprs"].items())
        if r["error"]:
            stats = "ERROR | | | |"
        else:
            stats = (f"{r['num_warps']}/{r['num_stages']} | {r['registers']} | {r['spill_stores']}/{r['spill_loads']}"
                     f" | {r['shared'] + r['static_smem']} |")
        lines.append(f"| {r['kernel']} | {r['geometry']} | {cx} | {', '.join(r['ones'])} | {stats} "
                     f"{r['cpu_seconds']} |")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------- versions
def fetch_triton(version: str) -> pathlib.Path:
    """build/triton-<version>/ holding that Triton (pip --no-deps --target), installed once."""
    dest = REPO / "build" / f"triton-{version}"
    if (dest / "triton" / "__init__.py").exists():
        return dest
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f"triton-{version}.", dir=dest.parent if dest.parent.exists()
                                        else _mkdir(dest.parent)))
    try:
        cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps",
               "--target", str(tmp), f"triton=={version}"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"pip could not install triton=={version}: {r.stderr.strip()[-1500:]}")
        try:
            tmp.rename(dest)  # atomic: a concurrent fetch either wins or finds it done
        except OSError:
            if not (dest / "triton" / "__init__.py").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _mkdir(p: pathlib.Path) -> pathlib.Path:
    p.mkdir(parents=True, exist_ok=True)
    return p


def run_version(version: str, out: pathlib.Path, jobs: int, grid: str) -> int:
    """This file in a subprocess whose Triton is `version` ("installed": the venv's own)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the suite sets it on CPU
    path = [str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    cmd = [sys.executable, str(pathlib.Path(__file__).resolve()), "--worker", "--out", str(out.resolve()),
           "--jobs", str(jobs), "--grid", grid]
    if version != "installed":
        path.insert(0, str(fetch_triton(version)))
        cmd += ["--expect-version", version]
    env["PYTHONPATH"] = os.pathsep.join(path)
    with tempfile.TemporaryDirectory(prefix="triton-cache.") as cache:
        env["TRITON_CACHE_DIR"] = cache  # empty: every variant really compiles (and ptxas logs)
        return subprocess.run(cmd, env=env, cwd=REPO).returncode


def worker(out: pathlib.Path, jobs: int, grid: str, expect: str | None) -> int:
    """Record, compile and report with the Triton importable here; 0 when every check passed."""
    warnings.filterwarnings("ignore", message=".*TRITON_DEFAULT_FP_FUSION.*")
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("TRITON_INTERPRET=1 replaces the kernels by the interpreter: unset it")
    import torch
    import triton

    if expect and triton.__version__ != expect:
        raise SystemExit(f"expected Triton {expect}, imported {triton.__version__} from elsewhere")
    torch.set_num_threads(1)  # the recording runs tiny CPU tensor ops; keep the cores for compiling
    t0, c0 = time.perf_counter(), _cpu_seconds()
    variants, n = record_all(grid)
    t1, c1 = time.perf_counter(), _cpu_seconds()
    results = compile_all(variants, jobs)
    t2 = time.perf_counter()
    rows = [variant_row(v, r) for v, r in zip(variants, results)]
    seconds = dict(record=round(c1 - c0, 1), compile_cpu=round(sum(r["cpu_seconds"] for r in rows), 1),
                   compile_wall=round(t2 - t1, 1), total_wall=round(t2 - t0, 1))
    rec = build_record(rows, n, grid, seconds, jobs)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"triton-{rec['triton']}"
    (out / f"{stem}.json").write_text(dump_json(rec))
    (out / f"{stem}.md").write_text(markdown(rec))
    print(f"[compile_triton] Triton {rec['triton']}: {len(rows)} variants from {n} launches, "
          f"{seconds['compile_cpu']} CPU s ({seconds['compile_wall']} s wall): "
          f"{'PASS' if rec['ok'] else 'FAIL'} -> {stem}.md", flush=True)
    for f in rec["failures"]:
        print(f"  FAIL {f}")
    return 0 if rec["ok"] else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=pathlib.Path, required=True, help="folder for triton-<version>.json/.md")
    ap.add_argument("--triton", action="append", default=None,
                    help=f"'installed' or a version to fetch into build/ (repeatable; default: installed "
                         f"and {GPU_IMAGE_TRITON})")
    ap.add_argument("--grid", choices=("full", "ci"), default="full",
                    help="ci: fp32 training kernels only at CI_FP32_TRAINING (they take minutes of ptxas)")
    ap.add_argument("--jobs", type=int, default=len(os.sched_getaffinity(0)),
                    help="compile processes per version (default: the cores this process may run on)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--expect-version", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args.out, args.jobs, args.grid, args.expect_version)
    status = 0
    for version in args.triton or ["installed", GPU_IMAGE_TRITON]:
        try:
            rc = run_version(version, args.out, args.jobs, args.grid)
        except RuntimeError as e:  # the download failed: say so, distinctly
            print(f"[compile_triton] {e}", file=sys.stderr)
            return EXIT_FETCH
        status = status or rc
    return status


if __name__ == "__main__":
    sys.exit(main())
