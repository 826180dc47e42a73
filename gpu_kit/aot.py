"""FlashInfer modules compiled ahead of time for the GPU kit.

FlashInfer 0.6.12 JIT-compiles each attention module with nvcc on first use (about 1 minute for a
decode module, 2 for a prefill module, one core each) unless `<flashinfer>/data/aot/<uri>/<uri>.so`
exists: `JitSpec.build_and_load` loads that file and never calls the compiler (jit/core.py; the
directory is `jit/env.py`'s FLASHINFER_AOT_DIR). This module builds those files on a CPU machine with
its nvcc, for the modules the GPU tiers load, and packs them as a site-relative archive
(`flashinfer-aot-<version>-sm90a.tar.xz`, members `flashinfer/data/aot/<uri>/<uri>.so`) that
`kit.prepare_site` extracts over the site.

Which modules: not a hand-written list. `record_uris()` runs the real call sites on CPU with
FlashInfer's `JitSpec.build_and_load` replaced by a recorder: the project's
`FlashInferSparseDecode.plan` (G = 1 -> CUDA-core decode, G = 4 -> the fa2 prefill module that
`use_tensor_cores` decode runs), and SGLang 0.5.15's FlashInfer backend calls as written in its
flashinfer_backend.py (`BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", backend="fa2",
use_tensor_cores=should_use_tensor_core(...))`: G = 3 (SmolLM2) CUDA-core, G = 4 (Qwen3-4B) tensor
cores; `BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend="fa2").plan(...)`, the paged path
SGLANG_FLASHINFER_USE_PAGED=1 selects; no logits soft cap, no sliding window: Llama/Qwen3), for
q/kv/o dtypes bf16 and fp16 and head dims 64 and 128, int32 indices. The URIs come out of
FlashInfer's own `get_batch_decode_uri` / `get_batch_prefill_uri` through those calls.

    python gpu_kit/aot.py uris                 # worker: the recorded modules as JSON
    python gpu_kit/aot.py build --out DIR      # worker: compile them, DIR/aot/<uri>/<uri>.so

The workers need `flashinfer` importable (a `--target` install of the kit's wheel, see
`build_kit.flashinfer_scratch`), torch (CPU is enough) and, to build, nvcc and ninja. build_kit.py
runs them in that environment; `--aot` there is the entry point.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parent
FLASHINFER_VERSION = "0.6.12"
ARCH_LIST = "9.0a"  # FLASHINFER_CUDA_ARCH_LIST: Hopper (H100/H200) only
AOT_ARCHIVE = f"flashinfer-aot-{FLASHINFER_VERSION}-sm90a.tar.xz"
AOT_RECORD = HERE / "flashinfer-aot.json"  # committed: what the last full build made
AOT_PREFIX = "flashinfer/data/aot"
DTYPES = ("bfloat16", "float16")
HEAD_DIMS = (64, 128)
# (label, H_q, H_kv) of the dense SGLang models the tiers serve and the sas group sizes.
SGLANG_MODELS = (("smollm2-135m (G=3)", 9, 3), ("qwen3-4b (G=4)", 32, 8))
SAS_GROUPS = (1, 4)  # 1: CUDA-core decode module (G in {1, 2}); 4: tensor cores (fa2 prefill module)


def aot_member(uri: str) -> str:
    """Site-relative path FlashInfer loads a pre-built module from."""
    return f"{AOT_PREFIX}/{uri}/{uri}.so"


# ------------------------------------------------------------------------ worker side (flashinfer)
def _patch_for_cpu():
    """FlashInfer's wrappers pin a host buffer (needs CUDA); on CPU drop pin_memory."""
    import torch

    empty = torch.empty

    def _empty(*a, pin_memory=False, **k):
        return empty(*a, **k)

    torch.empty = _empty
    return lambda: setattr(torch, "empty", empty)


class _Recorder:
    """Wraps JitSpec.build_and_load: records the spec; with load=False returns a module whose
    functions accept anything (plan() then completes on CPU), with load=True calls FlashInfer's
    own build_and_load (which loads `aot_path` when the file exists, else compiles) and records
    what it returned."""

    def __init__(self, orig=None):
        self.specs = {}
        self.calls = []
        self.loaded = {}
        self.current = None
        self.orig = orig

    def site(self, label: str) -> None:
        """The next calls come from this call site. FlashInfer's module getters are
        functools.cache'd: forget them so every call site reaches build_and_load."""
        import flashinfer.decode
        import flashinfer.prefill

        flashinfer.decode.get_batch_decode_module.cache_clear()
        flashinfer.prefill.get_batch_prefill_module.cache_clear()
        self.current = label

    def __call__(self, spec):
        self.specs.setdefault(spec.name, spec)
        self.calls.append((self.current, spec.name))
        if self.orig is not None:
            mod = self.orig(spec)
            self.loaded[spec.name] = mod
            return _PlanOnCpu(mod)

        class _Fake:
            def __getattr__(self, name):
                return lambda *a, **k: []

        return _Fake()


class _PlanOnCpu:
    """A loaded module whose plan/run are not called on CPU (they would touch CUDA): the real
    module is kept in the recorder; the call sites get accept-anything functions."""

    def __init__(self, mod):
        self.mod = mod

    def __getattr__(self, name):
        getattr(self.mod, name)  # the real module must export it
        return lambda *a, **k: []


def record_specs(load: bool = False):
    """Run every call site on CPU with the recorder; returns (recorder, rows) where rows are
    {"uri", "kind", "used_by": [...]} in first-seen order. load: let FlashInfer load each module
    (from the AOT directory, or by compiling) instead of faking it."""
    import torch
    import flashinfer
    from flashinfer.jit import core

    sys.path.insert(0, str(REPO))
    from sas_backend.ops.sparse_decode.flashinfer import FlashInferSparseDecode

    orig = core.JitSpec.build_and_load
    rec = _Recorder(orig if load else None)
    core.JitSpec.build_and_load = lambda self: rec(self)
    restore = _patch_for_cpu()
    try:
        for dname in DTYPES:
            dt = getattr(torch, dname)
            for hd in HEAD_DIMS:
                for g in SAS_GROUPS:  # the project's own wrapper, as the sas backend builds it
                    rec.site(f"sas decode {dname} d{hd} G={g}")
                    fi = FlashInferSparseDecode(2, g, hd, dt, dt, "cpu", max_rows=8, top_k=4, block_size=64,
                                                workspace=torch.empty(1 << 20, dtype=torch.uint8))
                    fi.plan(torch.tensor([300, 1000]), hd**-0.5)
                    fi.plan(torch.tensor([300, 1000]), hd**-0.5, graph_bs=2)
                ws = torch.empty(1 << 20, dtype=torch.uint8)
                for label, hq, hkv in SGLANG_MODELS:
                    # flashinfer_backend.py: should_use_tensor_core() for bf16/fp16 KV is G >= 4
                    rec.site(f"sglang decode {label} {dname} d{hd}")
                    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", backend="fa2",
                                                                      use_tensor_cores=hq // hkv >= 4)
                    indptr = torch.tensor([0, 5, 9], dtype=torch.int32)
                    last = torch.ones(2, dtype=torch.int32)
                    w.begin_forward(indptr, torch.arange(9, dtype=torch.int32), last, hq, hkv, hd, 1,
                                    data_type=dt, q_data_type=dt, non_blocking=True, fixed_split_size=None,
                                    disable_split_kv=False)
                    rec.site(f"sglang paged prefill {label} {dname} d{hd}")
                    p = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend="fa2")
                    qo = torch.tensor([0, 3, 7], dtype=torch.int32)
                    p.begin_forward(qo, indptr, torch.arange(9, dtype=torch.int32), last, hq, hkv, hd, 1,
                                    q_data_type=dt, kv_data_type=dt, custom_mask=None, non_blocking=True,
                                    fixed_split_size=None, prefix_len_ptr=None, token_pos_in_items_ptr=None,
                                    token_pos_in_items_len=0, max_item_len_ptr=None)
    finally:
        restore()
        core.JitSpec.build_and_load = orig
    rows = {}
    for who, uri in rec.calls:
        row = rows.setdefault(uri, {"uri": uri, "kind": "decode" if uri.startswith("batch_decode") else "prefill",
                                    "used_by": []})
        if who not in row["used_by"]:
            row["used_by"].append(who)
    return rec, list(rows.values())


def readelf_needed(path) -> dict:
    """{"needed": [...], "runpath": str|None} from `readelf -d` (binutils)."""
    out = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True).stdout
    needed, runpath = [], None
    for line in out.splitlines():
        if "(NEEDED)" in line:
            needed.append(line.split("[", 1)[1].split("]", 1)[0])
        elif "(RUNPATH)" in line or "(RPATH)" in line:
            runpath = line.split("[", 1)[1].split("]", 1)[0]
    return {"needed": needed, "runpath": runpath}


def ldd_missing(path, lib_dirs=()) -> list:
    """Libraries `ldd` cannot resolve (with lib_dirs on LD_LIBRARY_PATH)."""
    env = dict(os.environ)
    if lib_dirs:
        env["LD_LIBRARY_PATH"] = os.pathsep.join([*map(str, lib_dirs), env.get("LD_LIBRARY_PATH", "")])
    out = subprocess.run(["ldd", str(path)], capture_output=True, text=True, env=env).stdout
    return [line.split("=>")[0].strip() for line in out.splitlines() if "not found" in line]


def build_all(out: pathlib.Path, only=None, log=print, build: bool = True) -> list:
    """Compile the recorded modules (FlashInfer's own ninja build, this environment's nvcc and
    FLASHINFER_CUDA_ARCH_LIST) and copy each to out/aot/<uri>/<uri>.so. A module already there
    is kept (so a build can resume). Returns the rows with bytes, seconds, sha256, NEEDED."""
    import hashlib
    import shutil

    rec, rows = record_specs()
    lib_dirs = [pathlib.Path(os.environ["CUDA_HOME"]) / "lib64"] if os.environ.get("CUDA_HOME") else []
    for row in rows:
        if only and row["uri"] not in only:
            continue
        dest = out / "aot" / row["uri"] / f"{row['uri']}.so"
        spec = rec.specs[row["uri"]]
        row["member"] = aot_member(row["uri"])
        row["built"] = dest.exists() or build
        if not dest.exists() and not build:
            continue
        if not dest.exists():
            # objects left by an interrupted build: those ninja does not rebuild make the seconds undercount
            before = {p.name: p.stat().st_mtime_ns for p in pathlib.Path(spec.build_dir).glob("*.o")}
            t0 = time.time()
            log(f"[aot] building {row['uri']} ({row['kind']}) ...")
            spec.build(verbose=False)
            resumed = sorted(n for n, t in before.items()
                             if (pathlib.Path(spec.build_dir) / n).exists()
                             and (pathlib.Path(spec.build_dir) / n).stat().st_mtime_ns == t)
            row["build_seconds"] = round(time.time() - t0, 1)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(spec.jit_library_path, dest)
            (dest.parent / "build_seconds").write_text(str(row["build_seconds"]))
            if resumed:
                (dest.parent / "build_resumed").write_text("\n".join(resumed) + "\n")
            log(f"[aot] built {row['uri']} in {row['build_seconds']} s, {dest.stat().st_size} bytes")
        else:
            secs = dest.parent / "build_seconds"
            row["build_seconds"] = float(secs.read_text()) if secs.exists() else None
        marker = dest.parent / "build_resumed"
        if marker.exists():  # build_seconds is the last part only: these objects came from an earlier run
            row["build_resumed_objects"] = len(marker.read_text().split())
        row["bytes"] = dest.stat().st_size
        row["sha256"] = hashlib.sha256(dest.read_bytes()).hexdigest()
        row.update(readelf_needed(dest))
        row["unresolved_with_toolkit"] = ldd_missing(dest, lib_dirs)
    return rows


def load_check(fake_load: bool = False) -> dict:
    """The loader contract, in this process: FlashInfer's compile step and ninja raise if called;
    every call site's module goes through FlashInfer's real `build_and_load`, which must find it
    in the AOT directory (`is_aot`) and load it with tvm_ffi (fake_load: tvm_ffi.load_module only
    records the path, for fake .so files). Returns {"modules": [{uri, is_aot, path, loaded}],
    "aot_dir", "compiled": [...]}."""
    import flashinfer.jit.cpp_ext as cpp_ext
    from flashinfer.jit import core
    from flashinfer.jit import env as jit_env

    compiled = []

    def no_compile(self, *a, **k):
        compiled.append(self.name)
        raise AssertionError(f"FlashInfer tried to compile {self.name}")

    core.JitSpec.build = no_compile
    cpp_ext.run_ninja = lambda *a, **k: (_ for _ in ()).throw(AssertionError("ninja called"))
    paths = {}
    if fake_load:
        class _Mod:
            def __getattr__(self, name):
                return lambda *a, **k: []

        def fake(path):
            paths[pathlib.Path(path).parent.name] = path
            return _Mod()

        core.tvm_ffi.load_module = fake
    rec, rows = record_specs(load=True)
    mods = []
    for r in rows:
        spec = rec.specs[r["uri"]]
        mods.append({"uri": r["uri"], "is_aot": spec.is_aot, "path": str(spec.aot_path),
                     "loaded": r["uri"] in rec.loaded, "tvm_ffi_path": paths.get(r["uri"])})
    return {"modules": mods, "aot_dir": str(jit_env.FLASHINFER_AOT_DIR), "compiled": compiled}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("uris", help="print the recorded modules as JSON")
    b = sub.add_parser("build", help="compile the recorded modules into OUT/aot/")
    b.add_argument("--out", required=True)
    b.add_argument("--only", nargs="*", help="just these URIs")
    b.add_argument("--status", action="store_true", help="compile nothing: report what OUT/aot holds")
    lc = sub.add_parser("loadcheck", help="load every module through FlashInfer with compiling disabled")
    lc.add_argument("--fake-load", action="store_true", help="record tvm_ffi.load_module's path (fake .so files)")
    args = ap.parse_args(argv)
    if args.cmd == "loadcheck":
        print("LOADCHECK " + json.dumps(load_check(args.fake_load)))
        return 0
    if args.cmd == "uris":
        _, rows = record_specs()
        print("AOT " + json.dumps(rows))
        return 0
    rows = build_all(pathlib.Path(args.out), args.only, log=lambda m: print(m, flush=True), build=not args.status)
    print("AOT " + json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
