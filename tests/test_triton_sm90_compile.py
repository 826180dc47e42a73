"""Every Triton kernel of the package compiles for sm_90 (H100), without a GPU.

`gpu_kit/compile_triton.py` records the launchers' real arguments on CPU tensors (no launch),
compiles each distinct variant for `cuda:90` and runs ptxas -v; it fails on a compile error,
shared memory above the H100's 227 KiB, a register spill in a serving kernel, or a package
@triton.jit function nothing compiled. Here it runs with Triton 3.6.0 (the GPU image's, the one the GPU runs
use; fetched from PyPI into build/ on first use), on its `ci` grid: the full grid less fp32 training kernels
outside one geometry (minutes of ptxas), less fp16 training kernels, and less the products of axes whose every
value it still compiles (`compile_triton.cases` says which); bench/results/2026-11-25-triton-sm90 compiled the
full grid. With SAS_SM90_BOTH_TRITONS=1 it also compiles with the Triton of this venv (the two together were 18
of CI's 47 minutes on 2026-12-01, so CI keeps the one the GPU image runs; `gpu_kit/compile_triton.py --grid ci`
runs both). The other tests check that the tool's checks can fail.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
TOOL = REPO / "gpu_kit" / "compile_triton.py"
import compile_triton as ct  # noqa: E402  (gpu_kit/, on pytest's pythonpath; stdlib-only at import)

SERVING_KERNELS = {
    "ops.gate._gate_query_kernel", "ops.gate._gate_query_partial_kernel", "ops.gate._gate_query_finish_kernel",
    "ops.summary._summarize_pages_kernel",
    "ops.summary._summary_update_decode_kernel", "ops.summary._summarize_listed_kernel",
    "ops.late_blocks._late_blocks_kernel",
    "ops.score._score_blocks_kernel",
    "ops.topk._chunk_select_kernel", "ops.topk._merge_select_kernel", "ops.gather._build_kv_indices_kernel",
    "ops.fused_step._front_kernel", "ops.fused_step._select_kernel", "ops.fused_step._attend_kernel",
    "ops.rerank._rerank_kernel", "ops.key_codes._encode_pages_kernel",
}
BOTH = os.environ.get("SAS_SM90_BOTH_TRITONS") == "1"
TRAINING_KERNELS = {"training.fused._fwd_kernel", "training.fused._delta_kernel", "training.fused._bwd_dq_kernel",
                    "training.fused._bwd_dkdv_kernel"}


def _env() -> dict:
    """This environment without TRITON_INTERPRET (the suite sets it on CPU; compiling needs it off)."""
    return {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    """(completed process, {triton version: JSON record}) of one run of the tool (VERSIONS)."""
    out = tmp_path_factory.mktemp("triton-sm90")
    versions = ["--triton", ct.GPU_IMAGE_TRITON] + (["--triton", "installed"] if BOTH else [])
    r = subprocess.run([sys.executable, str(TOOL), "--out", str(out), "--grid", "ci", *versions], env=_env(),
                       cwd=REPO, capture_output=True, text=True, timeout=3600)
    if r.returncode == ct.EXIT_FETCH:
        pytest.skip(f"Triton {ct.GPU_IMAGE_TRITON} could not be downloaded from PyPI: {r.stderr.strip()[-500:]}")
    recs = {}
    for p in out.glob("triton-*.json"):
        rec = json.loads(p.read_text())
        recs[rec["triton"]] = rec
    return r, recs


def test_every_kernel_compiles_for_sm90(records):
    r, recs = records
    assert r.returncode == 0, f"compile_triton failed:\n{r.stdout[-6000:]}\n{r.stderr[-3000:]}"
    want = {ct.GPU_IMAGE_TRITON} | ({importlib.metadata.version("triton")} if BOTH else set())
    assert set(recs) == want
    for version, rec in recs.items():
        assert rec["ok"] and rec["failures"] == [], (version, rec["failures"])
        assert rec["coverage"]["uncovered"] == [], version
        assert set(rec["kernels"]) == SERVING_KERNELS | TRAINING_KERNELS, version
        for row in rec["variants"]:
            assert row["error"] is None, (version, row["kernel"], row["error"])
            assert row["shared"] + row["static_smem"] <= ct.SMEM_LIMIT, (version, row["kernel"], row["geometry"])
            assert row["registers"] > 0, (version, row["kernel"])
            if row["kind"] == "serving":
                assert row["spill_stores"] == row["spill_loads"] == 0, (version, row["kernel"], row["geometry"])


def test_every_geometry_was_compiled(records):
    """Each geometry the README claims reached a compiled variant of each kernel that depends on it."""
    _, recs = records
    for version, rec in recs.items():
        seen = {}
        for row in rec["variants"]:
            seen.setdefault(row["op"], []).extend(row["cases"])

        def covered(op, **want):
            return any(all(c.get(k) == v for k, v in want.items()) for c in seen[op])

        for d in ct.HEAD_DIMS:
            for dg in ct.GATE_DIMS:
                for dtype in ct.DTYPES:
                    assert covered("summarize_pages", d=d, dg=dg, dtype=dtype), (version, d, dg, dtype)
                    for g in ct.GROUPS:
                        assert covered("gate_query", d=d, dg=dg, g=g, dtype=dtype), (version, d, dg, g, dtype)
            for g in ct.GROUPS:
                for dtype in ct.CI_HALF_TRAINING:
                    assert covered("gated_attention", d=d, g=g, dtype=dtype), (version, d, g, dtype)
        assert covered("gated_attention", dtype="fp32", **ct.CI_FP32_TRAINING), version
        full = rec["grid"] == "full"  # the CI grid compiles every K and every width, not every pair
        spec_k = ct.SPEC_GEOMETRY["k"]
        for budget in ct.BUDGETS:
            for m in ct.WIDTHS:
                if full or budget // ct.BLOCK == spec_k or m in ct.CI_TOPK_WIDTHS:
                    assert covered("topk", k=budget // ct.BLOCK, m=m), (version, budget, m)
        for d in ct.HEAD_DIMS:
            for dg in ct.GATE_DIMS:
                assert covered("summary_update", d=d, dg=dg, dtype="bf16"), (version, d, dg)
        for dtype in ct.DTYPES:
            for summaries in ("fp32", "bf16"):
                assert covered("summary_update", dtype=dtype, summaries=summaries), (version, dtype, summaries)
        assert covered("score", m=max(ct.WIDTHS)) and covered("topk", m=max(ct.SPEC_WIDTHS)), version
        # Phase 2 of Top-K (rows wider than one chunk) and the single-chunk path both compiled.
        chunk = [r for r in rec["variants"] if r["kernel"] == "ops.topk._chunk_select_kernel"]
        assert {r["constexprs"]["DIRECT"] for r in chunk} == {True, False}, version
        # The fused step's launch variants (bench_decode_step.VARIANTS): PDL on and off for each kernel, 8 warps.
        for kernel in ("_front_kernel", "_select_kernel", "_attend_kernel"):
            fused = [r for r in rec["variants"] if r["kernel"] == f"ops.fused_step.{kernel}"]
            assert {r["constexprs"]["PDL"] for r in fused} == {True, False}, (version, kernel)
        assert {r["num_warps"] for r in rec["variants"] if r["kernel"] == "ops.fused_step._attend_kernel"} >= {4, 8}


def _row(kind="serving", **kw):
    row = dict(kernel="k", kind=kind, geometry="g", error=None, shared=1024, static_smem=0, registers=40,
               spill_stores=0, spill_loads=0, constexprs={}, griddepcontrol=0)
    return {**row, **kw}


def test_checks_fail_on_errors_smem_spills_and_uncovered_kernels():
    clean = dict(uncovered=[])
    assert ct.check([_row(), _row(kind="training")], clean) == ([], [])
    failures, _ = ct.check([_row(error="CompilationError: at 3:4: bad")], clean)
    assert len(failures) == 1 and failures[0].startswith("compile error")
    failures, _ = ct.check([_row(shared=ct.SMEM_LIMIT + 1)], clean)
    assert len(failures) == 1 and failures[0].startswith("shared memory")
    assert ct.check([_row(shared=ct.SMEM_LIMIT)], clean)[0] == []  # the limit itself is allowed
    failures, _ = ct.check([_row(spill_stores=8)], clean)
    assert len(failures) == 1 and "spill" in failures[0]
    failures, notes = ct.check([_row(kind="training", spill_loads=8)], clean)
    assert (failures == []) == (not ct.TRAINING_SPILLS_FAIL) and len(failures) + len(notes) == 1
    # PDL: the grid dependency control must be in the PTX exactly when the variant asks for it
    assert ct.check([_row(constexprs=dict(PDL=True), griddepcontrol=2), _row(constexprs=dict(PDL=False))],
                    clean)[0] == []
    for bad in (_row(constexprs=dict(PDL=True)), _row(constexprs=dict(PDL=False), griddepcontrol=1)):
        failures, _ = ct.check([bad], clean)
        assert len(failures) == 1 and "griddepcontrol" in failures[0]
    failures, _ = ct.check([], dict(uncovered=["sas_backend.ops.x.triton._new_kernel"]))
    assert failures == ["not compiled by any recorded launch: sas_backend.ops.x.triton._new_kernel"]


BROKEN = '''
import triton
import triton.language as tl


@triton.jit
def bad_arange(x_ptr, N: tl.constexpr):
    tl.store(x_ptr + tl.arange(0, N), 1.0)  # N = 3: arange needs a power of two


@triton.jit
def huge_dot(a_ptr, b_ptr, c_ptr, M: tl.constexpr, K: tl.constexpr):
    i, k = tl.arange(0, M), tl.arange(0, K)
    a = tl.load(a_ptr + i[:, None] * K + k[None, :])
    b = tl.load(b_ptr + k[:, None] * M + i[None, :])
    tl.store(c_ptr + i[:, None] * M + i[None, :], tl.dot(a, b))
'''

PROBE = '''
import json, sys, torch
sys.path[:0] = [sys.argv[1], sys.argv[2]]
import compile_triton as ct, broken

calls = []
with ct.recording(calls):
    broken.bad_arange[(1,)](torch.empty(4), N=3)
    a = torch.empty(128, 512, dtype=torch.float16)
    broken.huge_dot[(1,)](a, a, torch.empty(128, 128), M=128, K=512, num_stages=1)
rows = []
for fn, sig, cx, attrs, opt in calls:
    v = dict(fn=fn, signature=sig, constexprs=cx, attrs=attrs, options=opt, op="probe", cases=[{}])
    rows.append(ct.variant_row(v, ct.compile_variant(v)))
package = ct.coverage(set())["uncovered"]
print(json.dumps(dict(failures=ct.check(rows, dict(uncovered=[]))[0], package_uncovered=package,
                      shared=[r.get("shared") for r in rows])))
'''


def test_real_compile_errors_and_shared_memory_are_caught(tmp_path):
    """A kernel Triton refuses and one needing 256 KiB of shared memory fail the check; with no
    recorded launch every package kernel counts as uncovered."""
    (tmp_path / "broken.py").write_text(BROKEN)
    (tmp_path / "probe.py").write_text(textwrap.dedent(PROBE))
    env = {**_env(), "TRITON_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, str(tmp_path / "probe.py"), str(TOOL.parent), str(tmp_path)], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert any("compile error" in f and "bad_arange" in f for f in out["failures"]), out
    assert any("shared memory" in f and "huge_dot" in f for f in out["failures"]), out
    assert {_full_id(k) for k in SERVING_KERNELS | TRAINING_KERNELS} <= set(out["package_uncovered"]), out


def _full_id(short: str) -> str:
    """'ops.gate._gate_query_kernel' -> 'sas_backend.ops.gate.triton._gate_query_kernel' (and the
    training kernels' module)."""
    mod, name = short.rsplit(".", 1)
    mod = mod.replace("training.fused", "training.ops.gated_attention.fused") if mod.startswith("training") \
        else mod + ".triton"
    return f"sas_backend.{mod}.{name}"


SERVED_PROBE = '''
import json, sys, time
sys.path.insert(0, sys.argv[1])
import compile_triton as ct
from sas_backend.ops import fused_step as fused


def configs(op_params, sizes=None):
    """{config_key: (op, params)} of the recorded launches (nothing compiled)."""
    out, calls = {}, []
    with ct.recording(calls):  # one recorder: its binders are made once per kernel
        for op, p in op_params:
            start = len(calls)
            ct.launch(op, p, sizes)
            for fn, sig, cx, attrs, opt in calls[start:]:
                out.setdefault(ct.config_key(fn, sig, cx, opt), (op, p))
    return out


compiled = configs((op, p) for op, ps in ct.cases("ci").items() if op.startswith("decode_") for p in ps)
sg = ct.SPEC_GEOMETRY
spec = dict(h_kv=8, d=sg["d"], dg=sg["dg"], g=sg["g"])
ks = [b // ct.BLOCK for b in ct.BUDGETS]
launched = []
# The front: both served dtypes, PDL on and off, any batch.
launched += [("decode_front", dict(spec, bs=bs, dtype="bf16", weights=dt, summaries=dt, pdl=pdl, **sub, **kv))
             for dt in ct.SERVED_DTYPES for pdl in (False, True) for bs in (1, 3, 8, 64, 256)
             for sub in [{}] + [dict(sub=n) for n in ct.SERVED_SUB_BLOCKS]
             for kv in [{}] + [dict(kv=x) for x in ct.SERVED_FP8 if dt == "bf16"]]
# The front writing 4-bit key codes too (--sas-rerank-keys int4).
launched += [("decode_front", dict(spec, bs=bs, dtype="bf16", weights=dt, summaries=dt, pdl=pdl, codes=True, **sub))
             for dt in ct.SERVED_DTYPES for pdl in (False, True) for bs in (1, 3, 8, 64, 256)
             for sub in [{}] + [dict(sub=n) for n in ct.SERVED_SUB_BLOCKS]]
# Select: every budget at widths from 1 block to 256K tokens (every 31st width: a chunk is at least 64 wide, so every
# chunk count; and the servers' own:
# SGLang's context_length + 4 for context lengths of every 4K), the benchmark's chunks at the spec K.
widths = sorted(set(range(1, ct.SERVED_MAX_BLOCKS + 1, 31)) | {(c * 1024 + 4) // 64 for c in range(4, 257, 4)})
for k in ks:
    for v in [{}] + ([dict(chunk=c) for c in ct.SERVED_CHUNKS] if k == sg["k"] else []):
        launched += [("decode_select", dict(h_kv=8, dg=sg["dg"], k=k, bs=1, m=m, anchors=4, summaries="bf16",
                                            sink=1, local=1, **v)) for m in widths]
launched += [("decode_select", dict(h_kv=8, dg=sg["dg"], k=sg["k"], bs=1, m=m, anchors=4, summaries="fp32", sink=1,
                                    local=1)) for m in widths]
# Sub-block summaries (--sas-sub-blocks) at the serve default budget (the spec K), both dtypes, the default chunk.
for n in ct.SERVED_SUB_BLOCKS:
    launched += [("decode_select", dict(h_kv=8, dg=sg["dg"], k=sg["k"], bs=1, m=m, anchors=4, summaries=dt, sink=1,
                                        local=1, sub=n)) for m in widths for dt in ct.SERVED_DTYPES]
# Attend: every budget at every batch size of the fused workspace, the benchmark's programs at the spec K.
for k in ks:
    for v in [{}] + ([dict(programs=p) for p in ct.SERVED_PROGRAMS] if k == sg["k"] else []):
        launched += [("decode_attend", dict(spec, bs=bs, dtype="bf16", k=k, **v))
                     for bs in range(1, ct.SERVED_ROWS + 1)]
# An fp8 KV cache at the serve default budget: the attend's fp8 loads at every batch size.
launched += [("decode_attend", dict(spec, bs=bs, dtype="bf16", k=sg["k"], kv=x))
             for x in ct.SERVED_FP8 for bs in range(1, ct.SERVED_ROWS + 1)]
# Two levels at the serve default budget (--sas-exact-rerank 2 and 4): the attend ranks the second level, bf16 and
# fp8 K / V, at every batch size.
launched += [("decode_attend", dict(spec, bs=bs, dtype="bf16", k=sg["k"], x=x)) for x in (2, 4)
             for bs in range(1, ct.SERVED_ROWS + 1)]
launched += [("decode_attend", dict(spec, bs=bs, dtype="bf16", k=sg["k"], x=2, kv=kv)) for kv in ct.SERVED_FP8
             for bs in range(1, ct.SERVED_ROWS + 1)]
t0 = time.time()
got = configs(launched, fused.default_sizes(cuda=True))  # a CUDA workspace's split sizes, whatever the grid uses
missing = [got[k] for k in got if k not in compiled]
print(json.dumps(dict(launched=len(launched), configs=len(got), compiled=len(compiled), missing=missing[:20],
                      n_missing=len(missing), seconds=round(time.time() - t0, 1))))
'''


def test_every_configuration_the_cuda_path_launches_is_compiled(tmp_path):
    """Issue 64 item 4: the fused step's launches as the CUDA path makes them (the GPU's front units from
    ops.fused_step.default_sizes, its attend splits at every batch size up to the fused workspace's rows, select at
    every budget over widths up to 256K tokens, both served dtypes, the benchmark's variants) are recorded densely,
    nothing compiled, and each configuration (`compile_triton.config_key`: kernel, constexprs, dtypes, options) must
    be one the CI grid compiles. Before, the grid built the front with the CPU's one unit per head (QCHUNK 64)."""
    (tmp_path / "probe.py").write_text(SERVED_PROBE)
    env = {**_env(), "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, str(tmp_path / "probe.py"), str(TOOL.parent)], env=env, cwd=REPO,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["launched"] > 2500 and out["configs"] > 30, out
    assert out["n_missing"] == 0, out


DEDUPE_PROBE = '''
import json, sys
sys.path.insert(0, sys.argv[1])
import compile_triton as ct

kept, n = ct.record_all("ci")
ct.one_per_configuration = lambda variants: variants  # the CI grid's launches, every specialization its own variant
full, _ = ct.record_all("ci")
keys = lambda vs: [(v["op"], ct.config_key(v["fn"], v["signature"], v["constexprs"], v["options"])) for v in vs]
cases = lambda vs: sorted({(v["op"], json.dumps(c, sort_keys=True)) for v in vs for c in v["cases"]})
print(json.dumps(dict(kept=len(kept), every=len(full), unique=len(set(keys(kept))), configs=len(set(keys(full))),
                      same_cases=cases(kept) == cases(full))))
'''


def test_the_ci_grid_compiles_one_variant_per_configuration_and_drops_no_case(tmp_path):
    """`compile_triton.one_per_configuration`: the CI grid keeps one variant per (op, configuration), every
    configuration its launches reach, and every case (the geometry checks above read the cases) on a kept variant."""
    (tmp_path / "probe.py").write_text(DEDUPE_PROBE)
    r = subprocess.run([sys.executable, str(tmp_path / "probe.py"), str(TOOL.parent)],
                       env={**_env(), "PYTHONPATH": str(REPO)}, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["kept"] == out["unique"] == out["configs"], out
    assert out["every"] > out["kept"] and out["same_cases"], out
