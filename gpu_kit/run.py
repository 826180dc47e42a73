"""One command per GPU tier: unpack the kit, install this package, run the tier, write the results.

    python3 gpu_kit/run.py tier0 --kit .whl/site # preflight, < 2 min: GPU, kit, imports, toolchain, kernels
    python3 gpu_kit/run.py tier1 [--quick]       # torch + Triton + FlashInfer (no SGLang)
    python3 gpu_kit/run.py tier2 [--quick]       # the real SGLang server, dense vs sas
    python3 gpu_kit/run.py session --kit .whl/site  # the first call of a 15-minute device session (below)
    python3 gpu_kit/run.py session2 --no-install    # its second call, on the warm machine: the rest
    python3 gpu_kit/run.py tier1 --dry-run       # on a CPU machine: everything up to where CUDA is needed

Steps of every tier: (1) the kit in `.whl/` (gpu_kit/kit.py) is checked against SHA256SUMS,
unpacked into `--site` (default /tmp/site) and this repository is installed there with
`pip install --no-index --no-deps --no-build-isolation --no-compile --target`; (2) the Python side
is imported from there (`imports`); (3) the tier's tests and benchmarks run one after another in
that environment (PYTHONPATH=site:repo, FlashInfer JIT settings), each under its own time limit
that the tier's `--budget-min` caps; (4) `<tier>.json`, `<tier>.md` and `<tier>.log` plus the
benchmarks' PNGs land in `--out` (default $OUT, else bench/out/gpu/). The summary is rewritten after
every step, so a run cut short still returns what finished.

Every tier runs with CUDA_HOME set to the real toolkit (not the folder of a `nvcc` wrapper),
FlashInfer's JIT link flags completed where the toolkit lacks `lib64/stubs/libcuda.so` (a link shim
to the driver's libcuda.so.1: kit.jit_env) and SGLANG_FLASHINFER_USE_PAGED=1; the kit's pre-built
FlashInfer modules (flashinfer-aot-*.tar.xz) are extracted over the site, so FlashInfer loads them
instead of compiling.

Tier 0 (gpu_kit/preflight.py): nvidia-smi and torch.cuda see an sm90 GPU; the kit's sha256s; the
imports (sas_backend, flashinfer, sglang where the kit has it); the AOT modules in place; CUDA_HOME,
nvcc and a test link with FlashInfer's link line; one Triton kernel of the package vs its torch
reference; FlashInfer sparse decode vs the torch reference with JIT disabled (every module from the
kit); one sgl_kernel op vs torch. Stops at the first failure of a prerequisite and says why.

Tier 1, in this order: the standalone decode-step benchmark (bench_decode_step.py: Qwen3-4B shapes,
every kernel vs its reference up to 128K, timings 8K..256K, batch 1 and 8, budgets 1024/2048/4096,
per-op breakdown, roofline); the gated training kernel fwd+bwd vs the reference and SDPA
(bench/bench_gated_attention.py); the kernel tests (tests/ops, the fused decode step against the per-op
step in tests/test_decode_step_object.py, the gated-attention kernel tests, FlashInfer sparse decode eager and in a
CUDA graph) compiled on the GPU against their torch references.
Tier 2: make a Qwen3-4B-shaped model (4 layers with random weights for the tests; 36 layers,
`--load-format dummy`, for the benchmark) and seeded gates (make_model.py); the server tests
(tests/gpu/test_server_gpu.py: graph == eager, covering budget == dense FlashInfer, memory
reservation; tests/gpu/test_decode_step_gpu.py: no host sync, launches per layer) with chunked
prefill and a radix-cache prefix; then end-to-end decode latency dense vs sas at 32K..128K, batch
1 and 8 (bench/bench_decode.py).

Session (a device session has 15 minutes in all, a call at most 10, a machine start 1-2), first call, planned to
fit --budget-min (9.3) with every step at its full expected minutes (tests/test_gpu_kit.py), most important first:
the preflight (nothing else runs if it fails); `kernel-checks`: every kernel against its reference and the served
CUDA configuration (bf16 summaries, bf16 gate weights, prompt anchors on and off) at 8K, 32K, 128K batch 1 and 32K
batch 8; `decode-step`: the fused step against dense and the old step at 8K, 32K, 128K, 256K batch 1 and 32K batch 8,
budget 2048 (steady, block, amortized; the server's slot-table width); `e2e-decode`: dense and sas servers at 8K
and 32K batch 1 and 32K batch 8; `tournament`: the new step's variants at those points, each checked, and
chosen-settings.json. `session2 --no-install` (the second call): the server tests, the top-k sweep, the gated
kernel at 4K-8K, the kernel tests. A step whose expected minutes do not fit in what is left of --budget-min (at
FIT_FACTOR) is skipped (recorded why), so the call returns inside its limit; every benchmark writes its record
after each point, so a step killed at the limit keeps what it measured.

--dry-run (any machine, no CUDA): the same kit steps into a scratch site, imports of what needs no
CUDA (the kit's compiled packages only where this Python matches the kit's), `pytest --collect-only`
for every test step and each benchmark's own --dry-run (tiny shapes through the torch paths), then
the same summary files; it stops there with a message naming what needs CUDA.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
import time

import kit  # beside this script

# The runner runs under the machine's bare python3, before any kit is unpacked: the tree's own package (its
# result writers) is importable from the repository root.
sys.path.insert(0, str(kit.REPO))

REPO = kit.REPO
PY = sys.executable


@dataclasses.dataclass
class Step:
    """One command of a tier. argv/dry_argv use `{work}`, `{py}` placeholders; dry_argv None: the
    step has no CPU rehearsal. produces: files under {work} that the step writes (JSON to embed,
    PNGs to copy to --out)."""

    name: str
    argv: list
    minutes: float  # expected device minutes (H200, 2026-11-27: preflight 0.8, decode-step 1.0, server-tests 5.2)
    dry_argv: list | None = None
    env: dict = dataclasses.field(default_factory=dict)
    produces: tuple = ()
    needs: tuple = ()  # steps that must run first (added when --only names this one)
    stop_on_fail: bool = False  # a failure skips every later step (the preflight: fix it first)


PYTEST = ["{py}", "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider"]
TIER1_TESTS = ["tests/ops", "tests/test_decode_step_object.py", "tests/training/test_gated_attention.py",
               "tests/gpu/test_flashinfer_sparse_decode.py",
               "tests/test_graph_branch.py", "tests/gpu/test_sas_training_gpu.py"]
TIER2_TESTS = ["tests/gpu/test_server_gpu.py", "tests/gpu/test_decode_step_gpu.py"]
TEST_MODEL, BENCH_MODEL = "{work}/models/qwen3-4b-4l", "{work}/models/qwen3-4b-shape"
SERVER_TEST_FLAGS = "--chunked-prefill-size 1024 --grammar-backend none --cuda-graph-max-bs 8"
E2E_FLAGS = ["--load-format", "dummy", "--grammar-backend", "none", "--cuda-graph-max-bs", "8",
             "--mem-fraction-static", "0.85"]


def e2e_argv(model: str, contexts, dry: bool = False, points=None) -> list:
    """bench/bench_decode.py on `model` and its `-gate` (every context at batch 1 and 8, or `points`); dry: the same
    flags, nothing started."""
    where = ["--points", *points] if points else ["--contexts", *contexts, "--batch", "1", "8"]
    return ["{py}", "bench/bench_decode.py", "--model", model, "--gate", model + "-gate", *where,
            "--budget", "2048", "--new-tokens", "64", "--shared-prefix", "--report",
            "--out", "{work}/e2e", *(["--dry-run"] if dry else []), "--extra", *E2E_FLAGS]


# The first command's measurements (issue 64 item 2), at the served configuration and the server's slot-table width:
# the points the fused step is judged at, those the kernels are checked at (up to 128K: the references' memory), and
# the end-to-end ones.
STEP_POINTS = ["8192x1", "32768x1", "131072x1", "262144x1", "32768x8"]
CHECK_POINTS = ["8192x1", "32768x1", "131072x1", "32768x8"]
E2E_POINTS = ["8192x1", "32768x1", "32768x8"]
STEP = ["{py}", "gpu_kit/bench_decode_step.py", "--out", "{work}"]
# The variants, each checked, deciding chosen-settings.json; dense_below from the decode-step's IF-node timings.
TOURNAMENT = [*STEP, "--name", "tournament", "--variants", "tournament", "--no-check", "--no-branches",
              "--branches-from", "{work}/decode-step.json"]


def first_command_steps() -> list:
    """The session's first command after the preflight, in the order of what matters most: the kernels checked at the
    served CUDA configuration, the fused step against dense and the old one, end to end through the servers, then
    the tournament of variants (which writes chosen-settings.json)."""
    return [
        Step("kernel-checks", [*STEP, "--name", "kernel-checks", "--checks-only", "--budgets", "2048", "--points",
                               *CHECK_POINTS], 0.8,
             [*STEP, "--name", "kernel-checks", "--checks-only", "--dry-run"], produces=("kernel-checks.json",)),
        Step("decode-step", [*STEP, "--variants", "core", "--no-check", "--no-profile", "--budgets", "2048",
                             "--points", *STEP_POINTS], 1.5,
             [*STEP, "--variants", "core", "--no-check", "--no-profile", "--dry-run"],
             produces=("decode-step.json", "decode-step.png")),
        Step("make-bench-model", ["{py}", "gpu_kit/make_model.py", "--out", BENCH_MODEL], 0.3,
             ["{py}", "gpu_kit/make_model.py", "--out", "{work}/models/tiny-dummy", "--tiny", "--check"]),
        Step("e2e-decode", e2e_argv(BENCH_MODEL, None, points=E2E_POINTS), 3.5,
             e2e_argv("{work}/models/tiny-dummy", None, dry=True, points=E2E_POINTS), produces=("e2e",),
             needs=("make-bench-model",)),
        Step("tournament", [*TOURNAMENT, "--budgets", "2048", "--points", *STEP_POINTS], 2.0,
             [*TOURNAMENT, "--dry-run"],
             produces=("tournament.json", "tournament.png", "chosen-settings.json")),
    ]


def sub_block_cost_step() -> Step:
    """The served step with one and with 4 sub-block summaries, with an fp8 e4m3 KV cache and with two levels side
    by side (bench_decode_step.COSTS; issue 63's candidate selector settings, issue 66's fp8 point): the second
    command's last step, at 32K and 256K batch 1 and 32K batch 8."""
    return Step("sub-block-cost", [*STEP, "--name", "sub-block-cost", "--variants", "costs", "--no-check",
                                   "--no-branches", "--no-profile", "--budgets", "2048", "--points", "32768x1",
                                   "262144x1", "32768x8"], 1.2,
                [*STEP, "--name", "sub-block-cost", "--variants", "costs", "--no-check", "--no-branches",
                 "--no-profile", "--dry-run"], produces=("sub-block-cost.json",))


# A step skipped for time when its expected minutes exceed what is left by this factor (the estimates
# are not measured yet; a step that overruns is killed at the budget anyway)
FIT_FACTOR = 0.6
TIERS = ("tier0", "tier1", "tier2", "session", "session2")
BUDGET_MIN = 9.3  # wall minutes of one command (a call has 10; the rest is the start and the transfers)


def fits(left_s: float, minutes: float) -> bool:
    """Whether a step expected to take `minutes` may start with `left_s` seconds of the budget left."""
    return left_s >= 20 and left_s >= FIT_FACTOR * minutes * 60


def tier_steps(tier: str, quick: bool) -> list:
    """The steps of a tier (quick: smaller sizes, for a first look within a few minutes). "session":
    those of tiers 0-2 in the order a 15-minute device session should spend its minutes."""
    if tier == "session":  # the first command: what matters most, planned to fit BUDGET_MIN at factor 1.0
        return tier_steps("tier0", quick) + first_command_steps()
    if tier == "session2":  # the second command on the warm machine (--no-install): the rest
        by_name = {s.name: s for t in ("tier1", "tier2") for s in tier_steps(t, quick)}
        small = tier_steps("tier1", quick=True)  # gated 4K-8K
        by_name.update({s.name: s for s in small if s.name == "gated-attention"})
        order = ("make-test-model", "server-tests", "topk-sweep", "gated-attention", "kernel-tests")
        return [by_name[n] for n in order] + [sub_block_cost_step()]
    if tier == "tier0":
        return [Step("preflight", ["{py}", "gpu_kit/preflight.py", "--site", "{site}", "--out", "{work}",
                                   "--record", "{aot_record}"], 1.0,
                     ["{py}", "gpu_kit/preflight.py", "--site", "{site}", "--out", "{work}", "--record",
                      "{aot_record}", "--dry-run"],
                     produces=("preflight.json",), stop_on_fail=True)]
    if tier == "tier1":  # the benchmarks first: FlashInfer's JIT for the tests' other dtypes may run long
        step_args = ["--quick"] if quick else []
        sizes = ["4096", "8192"] if quick else ["4096", "8192", "16384", "32768"]
        return [
            # old step vs the new one and its variants (the tournament), then chosen-settings.json
            Step("decode-step", ["{py}", "gpu_kit/bench_decode_step.py", "--out", "{work}", *step_args], 4.5,
                 ["{py}", "gpu_kit/bench_decode_step.py", "--out", "{work}", "--dry-run"],
                 produces=("decode-step.json", "decode-step.png", "chosen-settings.json")),
            Step("topk-sweep", ["{py}", "bench/bench_topk.py", "--sweep", "--json", "{work}/topk-sweep.json"], 1.0,
                 ["{py}", "bench/bench_topk.py", "--sweep", "--dry-run", "--json", "{work}/topk-sweep.json"],
                 produces=("topk-sweep.json",)),
            Step("gated-attention", ["{py}", "bench/bench_gated_attention.py", "--sizes", *sizes,
                                     "--json", "{work}/gated-attention.json"], 1.5,
                 ["{py}", "bench/bench_gated_attention.py", "--dry-run", "--sizes", *sizes],
                 produces=("gated-attention.json",)),
            Step("kernel-tests", [*PYTEST, "--junitxml", "{work}/kernel-tests.xml", *TIER1_TESTS], 4.0,
                 [*PYTEST, "--collect-only", *TIER1_TESTS]),
        ]
    if tier == "tier2":
        contexts = ["32768"] if quick else ["32768", "65536", "131072"]
        model_env = {"SAS_GPU_MODEL": TEST_MODEL, "SAS_GPU_GATE": TEST_MODEL + "-gate",
                     "SAS_GPU_SERVER_FLAGS": SERVER_TEST_FLAGS}
        return [
            Step("make-test-model", ["{py}", "gpu_kit/make_model.py", "--out", TEST_MODEL, "--layers", "4",
                                     "--weights"], 0.5,
                 ["{py}", "gpu_kit/make_model.py", "--out", "{work}/models/tiny", "--tiny", "--weights", "--check"]),
            Step("make-bench-model", ["{py}", "gpu_kit/make_model.py", "--out", BENCH_MODEL], 0.3,
                 ["{py}", "gpu_kit/make_model.py", "--out", "{work}/models/tiny-dummy", "--tiny", "--check"]),
            Step("server-tests", [*PYTEST, "--junitxml", "{work}/server-tests.xml", *TIER2_TESTS], 7.0,
                 [*PYTEST, "--collect-only", *TIER2_TESTS], env=model_env, needs=("make-test-model",)),
            Step("e2e-decode", e2e_argv(BENCH_MODEL, contexts), 5.0,
                 e2e_argv("{work}/models/tiny-dummy", contexts, dry=True), produces=("e2e",),
                 needs=("make-bench-model",)),
        ]
    raise SystemExit(f"unknown tier {tier!r}: {', '.join(TIERS)}")


def selected(steps, only=None, skip=()) -> set:
    """Names of the steps to run: `only` (default all) plus what they need, minus `skip`."""
    by_name = {s.name: s for s in steps}
    unknown = [n for n in list(only or []) + list(skip) if n not in by_name]
    if unknown:
        raise SystemExit(f"unknown step(s) {unknown}; this tier has {list(by_name)}")
    want = set(only or by_name)
    for name in list(want):
        want.update(by_name[name].needs)
    return want - set(skip)


# ------------------------------------------------------------------------------------- running
AOT_RECORD = str(pathlib.Path(__file__).resolve().parent / "flashinfer-aot.json")


def fill(argv, work: pathlib.Path, site: pathlib.Path | None = None, aot_record: str = AOT_RECORD) -> list:
    """Placeholders -> values."""
    return [a.replace("{work}", str(work)).replace("{py}", PY).replace("{site}", str(site))
            .replace("{aot_record}", aot_record) for a in argv]


def shown(argv) -> str:
    """A command as it is recorded: the interpreter as `python3`, scratch paths as they are."""
    return " ".join(shlex.quote("python3" if a == PY else a) for a in argv)


def run_logged(argv, env, timeout_s: float, log) -> tuple:
    """Run argv in the repo root, its output streamed to stdout and the log; (rc, seconds, tail).
    rc 124 when the time limit ended it (its whole process group is killed)."""
    t0 = time.time()
    tail = collections.deque(maxlen=60)
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace", start_new_session=True)
    timed_out = False
    import threading

    def killer():
        nonlocal timed_out
        timed_out = True
        try:
            os.killpg(proc.pid, 9)
        except ProcessLookupError:
            pass

    timer = threading.Timer(max(timeout_s, 1), killer)
    timer.start()
    try:
        for line in proc.stdout:
            sys.stdout.write(line)
            log.write(line)
            tail.append(line.rstrip("\n"))
        proc.wait()
    finally:
        timer.cancel()
    log.flush()
    return (124 if timed_out else proc.returncode), round(time.time() - t0, 1), list(tail)


def pytest_counts(tail) -> dict:
    """{"passed": n, "failed": n, ...} from pytest's last summary line (or collect-only's count)."""
    counts = {}
    for line in reversed(tail):
        found = re.findall(r"(\d+) (passed|failed|errors?|skipped|deselected|xfailed|xpassed|tests? collected)", line)
        if found:
            for n, what in found:
                counts[what.rstrip("s") if what.startswith("error") else what] = int(n)
            break
    return counts


IMPORT_PROBE = r"""
import importlib, json, sys
out = {}
for name in sys.argv[1:]:
    try:
        m = importlib.import_module(name)
        out[name] = {"ok": True, "version": getattr(m, "__version__", None), "file": (getattr(m, "__file__", "") or "")}
    except Exception as e:
        out[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:300]}
print("IMPORTS " + json.dumps(out))
"""


def probe_imports(modules, env) -> dict:
    """Import each module in a fresh interpreter (cwd /, so only PYTHONPATH serves them)."""
    proc = subprocess.run([PY, "-c", IMPORT_PROBE, *modules], cwd="/", env=env, capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith("IMPORTS "):
            return json.loads(line[len("IMPORTS "):])
    return {"probe": {"ok": False, "error": proc.stderr[-500:]}}


TIER_MODULES = {
    "tier0": (["sas_backend", "sas_backend.ops.sparse_decode"], ["flashinfer"], []),
    "tier1": (["sas_backend", "sas_backend.ops.gate", "sas_backend.ops.sparse_decode",
               "sas_backend.training.ops.gated_attention"],
              ["flashinfer"], []),
    "tier2": (["sas_backend", "sas_backend.testing.server"],
              ["flashinfer", "sglang", "sas_backend.plugin", "sglang.srt.layers.attention.flashinfer_backend",
               "sas_backend.backend.sas_attention"],
              ["sgl_kernel"]),
}
TIER_MODULES["session"] = tuple(sorted({m for t in ("tier1", "tier2") for m in TIER_MODULES[t][i]}) for i in range(3))
TIER_MODULES["session2"] = TIER_MODULES["session"]


def check_imports(tier, site, env, dry: bool) -> dict:
    """Import the tier's Python side from the site. Dry run: the kit's compiled packages only where
    this Python is the kit's, CUDA-only modules never (recorded as not attempted, with the reason)."""
    plain, kit_built, cuda_only = TIER_MODULES[tier]
    if tier == "tier0" and (pathlib.Path(site) / "sglang").is_dir():  # a full kit: SGLang's side too
        kit_built = kit_built + ["sglang", "sglang.srt.layers.attention.flashinfer_backend"]
        cuda_only = cuda_only + ["sgl_kernel"]
    tag = kit.site_python_tag(site)
    here = f"{sys.version_info.major}{sys.version_info.minor}"
    mods, skipped = list(plain), {}
    for m in kit_built:
        if dry and tag and tag != here:
            skipped[m] = f"not attempted: the kit is built for CPython {tag[0]}.{tag[1:]}, this is {here[0]}.{here[1:]}"
        else:
            mods.append(m)
    for m in cuda_only:
        if dry:
            skipped[m] = "not attempted: loads CUDA libraries"
        else:
            mods.append(m)
    result = probe_imports(mods, env)
    for m, r in result.items():  # the package must come from the --target install, not the checkout
        if m.startswith("sas_backend") and r.get("ok"):
            r["from_site"] = r["file"].startswith(str(site))
        r.pop("file", None)
    result.update({m: {"ok": None, "skipped": why} for m, why in skipped.items()})
    return result


# ------------------------------------------------------------------------------------ reporting
def summary_markdown(rec: dict) -> str:
    """The tier's Markdown summary: environment, kit, imports, one line per step, then the steps' own."""
    from sas_backend.testing.report import env_markdown, md_table

    lines = [f"# GPU {rec['tier']} ({rec['mode']})", "", env_markdown(rec["environment"]), ""]
    if rec.get("kit"):
        k = rec["kit"]
        lines.append(f"- kit: {k.get('unpacked') or k.get('installed_wheels')}; checked {k.get('checked')}; "
                     f"{k.get('seconds')} s")
        aot_rec = k.get("aot")
        lines.append(f"- pre-built FlashInfer modules: {aot_rec['archive']} ({aot_rec['members']} members)" if aot_rec
                     else "- pre-built FlashInfer modules: none in this kit (FlashInfer JIT-compiles on first use)")
    if rec.get("jit"):
        c, link = rec["jit"]["cuda"], rec["jit"].get("link") or {}
        lines.append(f"- CUDA_HOME {c.get('cuda_home')} ({c.get('how')}); libcuda {link.get('libcuda')}; "
                     f"link shim {link.get('dir')}; SGLANG_FLASHINFER_USE_PAGED=1")
    if rec.get("imports"):
        bad = [m for m, r in rec["imports"].items() if isinstance(r, dict) and r.get("ok") is False]
        skipped = [m for m, r in rec["imports"].items() if isinstance(r, dict) and r.get("ok") is None]
        lines.append(f"- imports: {'all ok' if not bad else 'FAILED ' + ', '.join(bad)}"
                     + (f"; not attempted here: {', '.join(skipped)}" if skipped else ""))
    if rec.get("site_versions"):
        lines.append(f"- installed in the site (CPython {rec.get('kit_python')}): "
                     + ", ".join(f"{k} {v}" for k, v in rec["site_versions"].items()))
    if rec.get("stopped"):
        lines.append(f"- **stopped**: {rec['stopped']}")
    lines.append("")
    rows = [[s["name"], s["rc"], s["seconds"], s["expected_minutes"], json.dumps(s.get("counts", {})) or "",
             ("partial: " + ", ".join(s["partial"]) if s.get("partial") else ""), s.get("command", "")[:90]]
            for s in rec["steps"]]
    lines.append(md_table(["step", "rc", "seconds", "expected min", "counts", "record", "command"], rows))
    for s in rec["steps"]:
        if s.get("markdown"):
            lines += ["", s["markdown"]]
    return "\n".join(lines) + "\n"


def gated_markdown(result: dict) -> str:
    """The gated-attention bench rows as a table (ms and peak MiB per variant)."""
    from sas_backend.testing.report import md_table

    def ms(x):
        return x["ms"] if isinstance(x, dict) else x

    def mib(x):
        return x["peak_mib"] if isinstance(x, dict) else "-"

    rows = [[r["T"], r["attended"], ms(r["kernel"]), ms(r["naive"]), ms(r["dense"]), mib(r["kernel"]),
             mib(r["naive"]), mib(r["dense"])] for r in result["rows"]]
    return (f"## Gated attention fwd+bwd, budget {result['budget']}\n\n"
            + md_table(["T", "attended", "kernel ms", "naive ms", "SDPA ms", "kernel MiB", "naive MiB", "SDPA MiB"],
                       rows))


def collect(step: Step, work: pathlib.Path, out: pathlib.Path, rec: dict) -> None:
    """Embed the step's JSON and Markdown in its record and copy its PNGs to out. A produced name
    is a file (its .md and .png siblings count too) or a directory (all its files). Whatever exists is
    taken, from a finished step or one killed at its deadline: the benchmarks rewrite their records after
    every point (`complete` false until the end), so a killed step's record names it `partial`."""
    for name in step.produces:
        path = work / name
        files = sorted(path.iterdir()) if path.is_dir() else [path, path.with_suffix(".md"), path.with_suffix(".png")]
        for f in files:
            if not f.is_file():
                continue
            if f.suffix == ".json":
                try:
                    data = json.loads(f.read_text())
                except ValueError as e:  # a writer older than write_json_atomic, killed mid-write
                    rec.setdefault("unreadable", []).append(f"{f.name}: {e}"[:200])
                    continue
                rec.setdefault("results", {})[f.stem] = data
                if isinstance(data, dict) and data.get("complete") is False:
                    rec.setdefault("partial", []).append(f.stem)
                if f.stem == "gated-attention":
                    rec["markdown"] = gated_markdown(data)
            elif f.suffix == ".md":
                rec["markdown"] = f.read_text()
            elif f.suffix == ".png":
                shutil.copy(f, out / f.name)


def portable(text: str, site: pathlib.Path, work: pathlib.Path, out: pathlib.Path) -> str:
    """text with this run's folders as placeholders (<site>, <work>, <out>, the repository relative):
    the summaries are committed, and a path of the device machine means nothing elsewhere."""
    for path, name in ((work, "<work>"), (site, "<site>"), (out, "<out>"), (REPO, ".")):
        text = text.replace(str(path) + "/", "" if name == "." else name + "/").replace(str(path), name)
    return text


def write_summaries(rec: dict, stem: pathlib.Path, site: pathlib.Path, work: pathlib.Path) -> None:
    """stem.json and stem.md of a run's record, with its folders as placeholders (`portable`). Placeholders
    first, then the Markdown: it shortens long commands, and a path cut short would not be replaced (a
    machine path reached the committed summary that way, depending on how long the folder's name was)."""
    out = stem.parent
    shown = json.loads(portable(json.dumps(rec), site, work, out))
    kit.write_json(stem.with_suffix(".json"), shown)
    stem.with_suffix(".md").write_text(portable(summary_markdown(shown), site, work, out))


def default_kit(tier: str) -> pathlib.Path:
    """The kit directory a tier carries when --kit is not given (gpu_kit/README.md): `.whl/site`
    for tiers 0 and 2, `.whl/fi` for tier 1 (else `.whl/site`, which holds FlashInfer too), else a
    kit laid out directly in `.whl/` (the shared kit's form). The first that holds a kit."""
    base = kit.DEFAULT_KIT_DIR
    names = ["fi", "site"] if tier == "tier1" else ["site"]  # a session needs SGLang: the site kit
    cands = [base / n for n in names] + [base]
    for c in cands:
        found = kit.find_kit(c) if c.is_dir() else {}
        if found.get("site_archive") or (tier == "tier1" and found.get("flashinfer_wheels")):
            return c
    return cands[0]


def main(argv=None) -> int:
    """CLI (see the module doc); exit 0 when every step passed, 1 otherwise, 3 without a kit."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tier", choices=TIERS)
    ap.add_argument("--dry-run", action="store_true", help="CPU rehearsal: stop where CUDA is needed")
    ap.add_argument("--quick", action="store_true", help="smaller sizes (a first look)")
    ap.add_argument("--only", nargs="+", help="run only these steps (names as in the summary)")
    ap.add_argument("--skip", nargs="+", default=[], help="skip these steps")
    ap.add_argument("--kit", default=None, help="the kit directory (default: .whl/site for tiers 0 and 2, .whl/fi "
                    "for tier 1, else .whl/)")
    ap.add_argument("--site", default=None, help="install target (default /tmp/site; dry run: a scratch dir)")
    ap.add_argument("--no-install", action="store_true",
                    help="reuse --site as it is (a second command in the same lease)")
    ap.add_argument("--work", default=None, help="scratch for models and step outputs (default /tmp/sas-gpu[-dry])")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(REPO / "bench" / "out" / "gpu"))
    ap.add_argument("--aot-record", default=AOT_RECORD, help="the record of the kit's pre-built FlashInfer modules")
    ap.add_argument("--budget-min", type=float, default=BUDGET_MIN, help="wall minutes the whole tier may take")
    args = ap.parse_args(argv)
    args.kit = args.kit or str(default_kit(args.tier))
    t_start = time.time()
    deadline = t_start + args.budget_min * 60
    dry = args.dry_run
    site = pathlib.Path(args.site or ("/tmp/sas-gpu-dry-site" if dry else "/tmp/site"))
    work = pathlib.Path(args.work or ("/tmp/sas-gpu-dry" if dry else "/tmp/sas-gpu"))
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    tag = args.tier + ("-dry" if dry else "-quick" if args.quick else "")
    rec = {"tier": args.tier, "mode": "dry run" if dry else "quick" if args.quick else "full", "steps": []}

    def save():
        rec["wall_s"] = round(time.time() - t_start, 1)
        write_summaries(rec, out / tag, site, work)

    log = open(out / f"{tag}.log", "w")
    print(f"[gpu] {args.tier} ({rec['mode']}): site {site}, work {work}, results {out}", flush=True)
    try:
        if not args.no_install:
            if site.exists():
                shutil.rmtree(site)
            rec["kit"] = kit.prepare_site(pathlib.Path(args.kit), site,
                                          need_sglang=args.tier in ("tier2", "session", "session2"))
            print(f"[gpu] kit ready in {rec['kit']['seconds']} s: {rec['kit']}", flush=True)
    except kit.KitError as e:
        rec["stopped"] = f"kit: {e}"
        rec["environment"] = _environment(os.environ.copy())
        save()
        print(f"[gpu] STOP: {e}", file=sys.stderr)
        return 3
    env, rec["jit"] = kit.jit_env(kit.site_env(site), work / "link-shim")
    print(f"[gpu] CUDA for FlashInfer's JIT fallback: {json.dumps(rec['jit'])}", flush=True)
    if dry:
        env["TRITON_INTERPRET"] = "1"  # the CPU test conftest would set it too; benches import kernels directly
    tag_here = f"{sys.version_info.major}{sys.version_info.minor}"
    kit_tag = kit.site_python_tag(site)
    step_env = env
    if dry and kit_tag and kit_tag != tag_here:
        # The kit's compiled packages cannot load in this interpreter: rehearse the steps with the
        # package from the --target install in front of this environment's own libraries.
        step_env = dict(env, PYTHONPATH=os.pathsep.join([str(site / "_sas_only"), str(REPO)]),
                        PYTHONUNBUFFERED="1", TRITON_INTERPRET="1")
        shutil.copytree(site / "sas_backend", site / "_sas_only" / "sas_backend", dirs_exist_ok=True)
    rec["environment"] = _environment(step_env)
    rec["imports"] = check_imports(args.tier, site, env, dry)
    rec["kit_python"] = kit_tag
    rec["site_versions"] = kit.installed_versions(site, ["sglang", "sglang_kernel", "flashinfer_python",
                                                         "apache_tvm_ffi", "transformers", "sas_backend"])
    print(f"[gpu] imports: {json.dumps(rec['imports'])}", flush=True)
    save()
    failed_imports = [m for m, r in rec["imports"].items() if isinstance(r, dict) and r.get("ok") is False]
    rc_all = 1 if failed_imports else 0
    steps = tier_steps(args.tier, args.quick)
    wanted = selected(steps, args.only, args.skip)
    stop = None  # the failed stop_on_fail step
    for step in steps:
        if step.name not in wanted:
            continue
        argv = step.dry_argv if dry else step.argv
        srec = {"name": step.name, "expected_minutes": step.minutes}
        if stop:
            srec.update(rc=None, seconds=0, skipped=f"{stop} failed")
            rec["steps"].append(srec)
            continue
        if argv is None:
            srec.update(rc=None, seconds=0, command="(no CPU rehearsal)")
            rec["steps"].append(srec)
            continue
        argv = fill(argv, work, site, args.aot_record)
        srec["command"] = shown(argv)
        left = deadline - time.time()
        if not fits(left, step.minutes):
            srec.update(rc=None, seconds=0,
                        skipped=f"expected {step.minutes} min, {left / 60:.1f} min left in --budget-min")
            rec["steps"].append(srec)
            save()
            continue
        senv = dict(step_env, **{k: fill([v], work)[0] for k, v in step.env.items()})
        print(f"\n[gpu] === {step.name} (expected {step.minutes} min, limit {left / 60:.1f} min): {srec['command']}",
              flush=True)
        log.write(f"\n=== {step.name}: {srec['command']}\n")
        rc, secs, tail = run_logged(argv, senv, left, log)
        srec.update(rc=rc, seconds=secs)
        if "pytest" in argv:
            srec["counts"] = pytest_counts(tail)
        if rc not in (0, None):
            srec["tail"] = tail[-25:]
            rc_all = 1
            if step.stop_on_fail:
                stop = step.name
        if not dry or step.name in ("decode-step", "preflight", "kernel-checks", "tournament",
                                    "sub-block-cost"):  # the report path
            collect(step, work, out, srec)
        rec["steps"].append(srec)
        save()
    if dry:
        rec["stopped"] = ("dry run: kit unpacked, package installed, imports and test collection done; "
                          "stopping before anything that needs CUDA (compiled Triton, FlashInfer JIT, CUDA graphs, "
                          "GPU servers)")
        print(f"\n[gpu] {rec['stopped']}", flush=True)
    save()
    log.close()
    print("\n" + summary_markdown(rec))  # the end of the output is what a remote caller sees first
    print(f"[gpu] wrote {tag}.json, {tag}.md, {tag}.log under {out} ({rec['wall_s']} s)", flush=True)
    return rc_all


def _environment(env: dict) -> dict:
    """report.environment() run in the step environment (so versions are those the steps see)."""
    code = ("import json; from sas_backend.testing import report; "
            "print('ENV ' + json.dumps(report.environment()))")
    proc = subprocess.run([PY, "-c", code], cwd=REPO, env=env, capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith("ENV "):
            return json.loads(line[4:])
    return {"device": "unknown", "error": proc.stderr[-500:], "versions": {}, "git": {"commit": "unknown",
            "source": "-"}, "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "source_digest": ""}


if __name__ == "__main__":
    sys.exit(main())
