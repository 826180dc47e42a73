"""Faked-CUDA import check of a kit site on a CPU machine: does SGLang's serving path still import
after the kit was slimmed?

The kit is built for the GPU host's CPython 3.12 and CUDA torch; a CPU machine runs another
interpreter and CPU torch, so the check is a hybrid: the kit's pure-Python packages that slimming
touches (OVERLAY: sglang, transformers, flashinfer, sgl_kernel's Python side, with their dist-info)
go first on sys.path, everything compiled comes from this interpreter's environment, and CUDA is
faked (torch.cuda reports one H100, sm90, CUDA 13.0; sgl_kernel's op library is not loaded). Then
the modules of SGLang's startup path are imported, its model registry is built (every
sglang.srt.models module, as `launch_server` does) and the Llama/Qwen architectures are resolved,
and transformers' config/tokenizer classes for llama/qwen2/qwen3 are looked up.

    python gpu_kit/import_check.py --site DIR [--json OUT]

Prints `IMPORTCHECK {json}`: per module ok/error, the resolved architectures, the registry's
import failures, and which top-level packages and transformers.models.* were imported (the
evidence that the slimming rules in build_kit.SLIM remove nothing the path uses). Run it on the
full and the slimmed site and compare: `build_kit.py --import-check` does both.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

import kit  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]
OVERLAY = ("sglang", "transformers", "flashinfer", "sgl_kernel")
OVERLAY_DIST = ("sglang", "transformers", "flashinfer_python", "sglang_kernel")
STARTUP = [
    "sglang.launch_server", "sglang.srt.entrypoints.http_server", "sglang.srt.entrypoints.engine",
    "sglang.srt.managers.scheduler", "sglang.srt.managers.tokenizer_manager",
    "sglang.srt.managers.detokenizer_manager", "sglang.srt.model_executor.model_runner",
    "sglang.srt.layers.attention.flashinfer_backend", "sglang.srt.models.llama", "sglang.srt.models.qwen2",
    "sglang.srt.models.qwen3", "sglang.srt.entrypoints.openai.serving_chat",
    "sglang.srt.entrypoints.openai.serving_completions", "sglang.srt.model_loader.loader",
    "sas_backend.plugin", "sas_backend.backend.sas_attention",
]
ARCHS = ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]

CHILD = r"""
import ctypes, importlib, json, logging, os, sys, types, traceback
import torch

if os.environ.get("SAS_CHECK_LIBCUDART"):  # SGLang asserts libcudart is mapped (a CUDA torch maps it)
    ctypes.CDLL(os.environ["SAS_CHECK_LIBCUDART"], mode=ctypes.RTLD_GLOBAL)

# ---- fake one H100 (sm90, CUDA 13.0); nothing is ever launched
torch.version.cuda = "13.0"
torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: 1
torch.cuda.current_device = lambda: 0
torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
torch.cuda.get_device_name = lambda *a, **k: "NVIDIA H100 80GB HBM3"
torch.cuda.get_device_properties = lambda *a, **k: types.SimpleNamespace(
    name="NVIDIA H100 80GB HBM3", major=9, minor=0, total_memory=80 << 30, multi_processor_count=132,
    L2_cache_size=50 << 20, warp_size=32, gcnArchName="")
# ---- sgl_kernel: its Python side from the kit, its CUDA op library not loaded
lu = types.ModuleType("sgl_kernel.load_utils")
lu._load_architecture_specific_ops = lambda *a, **k: types.SimpleNamespace()
lu._preload_cuda_library = lambda *a, **k: None
sys.modules["sgl_kernel.load_utils"] = lu

# ---- cuda-python (cuda-bindings; on the GPU image) where this machine has none: attribute stubs
import importlib.util
if importlib.util.find_spec("cuda") is None:
    class _Any(types.ModuleType):
        def __getattr__(self, n):
            if n.startswith("__"):
                raise AttributeError(n)
            return type(n, (), {})
    for n in ("cuda", "cuda.bindings", "cuda.bindings.driver", "cuda.bindings.runtime", "cuda.bindings.nvrtc"):
        m = _Any(n)
        m.__path__ = []
        sys.modules[n] = m
    sys.modules["cuda"].bindings = sys.modules["cuda.bindings"]
    for n in ("driver", "runtime", "nvrtc"):
        setattr(sys.modules["cuda.bindings"], n, sys.modules["cuda.bindings." + n])

failures = []
class H(logging.Handler):
    def emit(self, r):
        m = r.getMessage()
        if "Ignore import error" in m:
            failures.append(m[:300])
logging.getLogger().addHandler(H())

out = {"modules": {}, "archs": {}, "registry_failures": failures, "transformers": {}}
for name in sys.argv[1].split(","):
    try:
        importlib.import_module(name)
        out["modules"][name] = "ok"
    except BaseException as e:
        out["modules"][name] = f"{type(e).__name__}: {e}"[:400]
try:
    from sglang.srt.models.registry import ModelRegistry
    for a in sys.argv[2].split(","):
        try:
            cls, arch = ModelRegistry.resolve_model_cls([a])
            out["archs"][a] = f"{cls.__module__}.{cls.__name__}"
        except BaseException as e:
            out["archs"][a] = f"{type(e).__name__}: {e}"[:300]
except BaseException as e:
    out["archs"]["registry"] = f"{type(e).__name__}: {e}"[:300]
try:
    import transformers
    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name
    for mt in ("llama", "qwen2", "qwen3"):
        try:
            out["transformers"][mt] = type(transformers.AutoConfig.for_model(mt)).__name__
        except BaseException as e:
            out["transformers"][mt] = f"{type(e).__name__}: {e}"[:300]
    for tok in ("PreTrainedTokenizerFast", "Qwen2Tokenizer", "Qwen2TokenizerFast", "LlamaTokenizerFast"):
        c = tokenizer_class_from_name(tok)
        out["transformers"][tok] = c.__name__ if c is not None else None
except BaseException as e:
    out["transformers"]["error"] = f"{type(e).__name__}: {e}"[:300]
mods = sorted(sys.modules)
out["top_level"] = sorted({m.split(".")[0] for m in mods})
out["transformers_models"] = sorted({m.split(".")[2] for m in mods
                                     if m.startswith("transformers.models.") and m.count(".") >= 2})
out["sglang_subpackages"] = sorted({".".join(m.split(".")[:3]) for m in mods
                                    if m.startswith("sglang.") and m.count(".") >= 2})
out["files_from_overlay"] = sorted({(getattr(sys.modules[m], "__file__", None) or "")
                                    for m in mods if m.split(".")[0] in sys.argv[3].split(",")})
print("IMPORTCHECK " + json.dumps(out))
"""


def make_overlay(site: pathlib.Path, dest: pathlib.Path) -> list:
    """Symlink the OVERLAY packages and their dist-info from `site` into `dest`."""
    dest.mkdir(parents=True, exist_ok=True)
    linked = []
    for name in OVERLAY:
        if (site / name).is_dir():
            (dest / name).symlink_to(site / name)
            linked.append(name)
    for info in site.glob("*.dist-info"):
        if info.name.split("-")[0].lower() in OVERLAY_DIST:
            (dest / info.name).symlink_to(info)
            linked.append(info.name)
    return linked


def check(site: pathlib.Path, extra_paths=(), timeout: int = 600) -> dict:
    """Run the check in a child interpreter; returns its record (with "error" on a crash).
    extra_paths: after the overlay, e.g. a directory holding nvidia-ml-py (`pynvml`, which the GPU
    image has and SGLang imports)."""
    site = pathlib.Path(site).resolve()
    with tempfile.TemporaryDirectory(prefix="sas-importcheck-") as tmp:
        overlay = pathlib.Path(tmp) / "overlay"
        linked = make_overlay(site, overlay)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(overlay), *map(str, extra_paths), str(REPO)]),
                   SGLANG_USE_CPU_ENGINE="0",
                   TRITON_INTERPRET="1", PYTHONDONTWRITEBYTECODE="1",
                   FLASHINFER_WORKSPACE_BASE=str(pathlib.Path(tmp) / "fi"))
        cuda_home = kit.find_cuda_home()["cuda_home"]
        if cuda_home and (pathlib.Path(cuda_home) / "lib64" / "libcudart.so.13").exists():
            env["SAS_CHECK_LIBCUDART"] = str(pathlib.Path(cuda_home) / "lib64" / "libcudart.so.13")
        proc = subprocess.run([sys.executable, "-c", CHILD, ",".join(STARTUP), ",".join(ARCHS), ",".join(OVERLAY)],
                              cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout)
        for line in proc.stdout.splitlines():
            if line.startswith("IMPORTCHECK "):
                rec = json.loads(line[len("IMPORTCHECK "):])
                rec["overlay"] = linked
                rec["files_from_overlay"] = len([f for f in rec["files_from_overlay"] if f.startswith(str(overlay))])
                return rec
        return {"error": (proc.stdout[-2000:] + proc.stderr[-3000:]), "overlay": linked}


def failures(rec: dict) -> list:
    """What a check record shows broken: a crash, a module that did not import, an architecture
    that did not resolve, a transformers lookup that raised. Empty: the serving path imports."""
    bad = [f"error: {rec['error'][-300:]}"] if "error" in rec else []
    bad += [f"modules.{m}: {v}" for m, v in rec.get("modules", {}).items() if v != "ok"]
    bad += [f"archs.{a}: {v}" for a, v in rec.get("archs", {}).items() if "ForCausalLM" not in v or ":" in v]
    bad += [f"transformers.{k}: {v}" for k, v in rec.get("transformers", {}).items()
            if k == "error" or (isinstance(v, str) and "Error" in v)]
    return bad


def compare(full: dict, slim: dict) -> list:
    """What the slimmed site lost against the full one: modules, archs or transformers lookups
    that were ok there and are not here, registry failures that are new. Empty: nothing."""
    lost = []
    for sect in ("modules", "archs", "transformers"):
        for k, v in full.get(sect, {}).items():
            if slim.get(sect, {}).get(k) != v:
                lost.append(f"{sect}.{k}: {v!r} -> {slim.get(sect, {}).get(k)!r}")
    new = set(slim.get("registry_failures", [])) - set(full.get("registry_failures", []))
    lost += [f"registry: {m}" for m in sorted(new)]
    return lost


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--site", required=True)
    ap.add_argument("--json")
    ap.add_argument("--extra-path", nargs="*", default=[], help="more sys.path entries (e.g. nvidia-ml-py)")
    args = ap.parse_args(argv)
    rec = check(pathlib.Path(args.site), args.extra_path)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(rec, indent=1) + "\n")
    print("IMPORTCHECK " + json.dumps(rec))
    return 0 if "error" not in rec else 1


if __name__ == "__main__":
    sys.exit(main())
