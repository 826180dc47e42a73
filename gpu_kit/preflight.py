"""Tier 0: a GPU preflight that fails fast and says why (run by `run.py tier0`, under 2 minutes).

Checks, in order (a failed check skips the checks that need it, each with the reason):

1. `gpu`: nvidia-smi answers (name, driver, memory); torch sees CUDA, an sm90 device, CUDA 13.x.
2. `aot`: every pre-built FlashInfer module of gpu_kit/flashinfer-aot.json is in the site at
   flashinfer/data/aot/<uri>/<uri>.so with the recorded sha256.
3. `toolchain`: CUDA_HOME is a real toolkit, nvcc runs, and a tiny .cu links with FlashInfer's JIT
   link line (`-L$CUDA_HOME/lib64 -L$CUDA_HOME/lib64/stubs $FLASHINFER_EXTRA_LDFLAGS -lcudart -lcuda`),
   so a module missing from the kit could still be compiled here.
4. `triton`: one compiled Triton kernel of the package (the KV index gather that feeds FlashInfer)
   equals its torch reference (exact).
5. `flashinfer`: FlashInferSparseDecode (sas_backend.ops.sparse_decode.flashinfer) equals the torch
   reference (naive.sparse_decode_attention) for bf16/fp16 x head dim 64/128 x G = 1 (CUDA-core
   decode module) and 4 (tensor cores: fa2 prefill module), every module loaded from the kit:
   FLASHINFER_DISABLE_JIT=1 makes FlashInfer raise instead of compiling, and each module's
   JitSpec must report is_aot.
6. `sgl_kernel` (when the site has SGLang): one sgl_kernel op (rmsnorm) equals torch: the kit's
   sgl_kernel has its non-sm90 GPU code zeroed (build_kit.prune_fatbin), this proves the sm90 code
   still loads.

    python gpu_kit/preflight.py --site SITE --out DIR [--dry-run]

Writes DIR/preflight.json; exit 1 when a check failed. --dry-run (CPU): `gpu` and the CUDA checks
are skipped, `aot` and `toolchain` (nvcc --version only) run, `triton` runs the kernel in Triton's
interpreter, `flashinfer` checks the loader contract (each recorded URI resolves to the shipped
file) where flashinfer imports.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
import aot  # noqa: E402
import kit  # noqa: E402


class Skip(Exception):
    """A check that cannot run here (dry run, or a prerequisite failed)."""


def check_gpu(dry: bool) -> dict:
    if dry:
        raise Skip("dry run: no GPU")
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=60)
    if smi.returncode != 0:
        raise AssertionError(f"nvidia-smi failed (rc {smi.returncode}): {smi.stderr.strip()[:300]}")
    import torch

    if not torch.cuda.is_available():
        raise AssertionError(f"torch {torch.__version__} sees no CUDA device (nvidia-smi: {smi.stdout.strip()})")
    cap = torch.cuda.get_device_capability()
    out = {"nvidia_smi": smi.stdout.strip(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
           "device": torch.cuda.get_device_name(), "capability": list(cap)}
    if cap != (9, 0):
        raise AssertionError(f"sm{cap[0]}{cap[1]}: the kit's FlashInfer modules and sgl_kernel are built for sm90 "
                             f"only ({out})")
    return out


def check_aot(site: pathlib.Path, record: dict) -> dict:
    missing, bad = [], []
    for m in record["modules"]:
        p = site / m["member"]
        if not p.is_file():
            missing.append(m["uri"])
        elif hashlib.sha256(p.read_bytes()).hexdigest() != m["sha256"]:
            bad.append(m["uri"])
    if missing or bad:
        raise AssertionError(f"AOT modules missing from the site: {missing}; sha256 differs: {bad} "
                             "(was the kit's flashinfer-aot archive carried and unpacked?)")
    return {"modules": len(record["modules"]), "dir": str(site / aot.AOT_PREFIX)}


def check_toolchain(dry: bool) -> dict:
    found = kit.find_cuda_home()
    home = os.environ.get("CUDA_HOME")
    if dry and not found["cuda_home"]:
        raise Skip(f"dry run: no CUDA toolkit on this machine ({found['how']})")
    if not home or not kit._is_toolkit(home):
        raise AssertionError(f"CUDA_HOME={home!r} is not a CUDA toolkit (bin/nvcc + include/cuda_runtime.h); "
                             f"found: {found}")
    nvcc = pathlib.Path(home) / "bin" / "nvcc"
    ver = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, timeout=60)
    if ver.returncode != 0:
        raise AssertionError(f"{nvcc} --version failed: {ver.stderr[-300:]}")
    out = {"cuda_home": home, "nvcc": next((ln for ln in ver.stdout.splitlines() if "release" in ln), ""),
           "extra_ldflags": os.environ.get("FLASHINFER_EXTRA_LDFLAGS", "")}
    if dry:
        out["link"] = "not attempted (dry run: no driver libcuda here)"
        return out
    with tempfile.TemporaryDirectory() as tmp:
        src = pathlib.Path(tmp) / "k.cu"
        src.write_text('#include <cuda.h>\n__global__ void k(float* x) { x[threadIdx.x] += 1.f; }\n'
                       'extern "C" int probe() { int v = 0; cuDriverGetVersion(&v); return v; }\n')
        cmd = [str(nvcc), "-shared", "-Xcompiler", "-fPIC", "-gencode=arch=compute_90a,code=sm_90a", str(src),
               "-o", str(pathlib.Path(tmp) / "k.so"), f"-L{home}/lib64", f"-L{home}/lib64/stubs",
               *os.environ.get("FLASHINFER_EXTRA_LDFLAGS", "").split(), "-lcudart", "-lcuda"]
        t0 = time.time()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise AssertionError(f"a .cu does not link with FlashInfer's JIT link line: {proc.stderr[-600:]}")
        import ctypes

        lib = ctypes.CDLL(str(pathlib.Path(tmp) / "k.so"))
        out.update(link_seconds=round(time.time() - t0, 1), driver_version=lib.probe())
    return out


def random_selection(lens, h_kv: int, k_top: int, b: int, g):
    """`[len(lens), h_kv, k_top]` int32: per (request, kv head) up to k_top distinct candidate blocks
    (those before the current block), ascending, -1 padded."""
    import torch

    sel = torch.full((len(lens), h_kv, k_top), -1, dtype=torch.int32)
    for r, n in enumerate(lens):
        cand = (n - 1) // b
        for h in range(h_kv):
            c = torch.randperm(cand, generator=g)[: min(k_top, cand)].sort().values
            sel[r, h, : c.numel()] = c.int()
    return sel


def check_triton(dry: bool) -> dict:
    import torch

    from sas_backend.ops.gather import gather_kv_indices, kv_indptr_for
    from sas_backend.ops.gather.torch_path import build_kv_indices

    dev = "cpu" if dry else "cuda"
    b, h_kv, k_top = 64, 2, 4
    lens = [1, 64, 65, 300, 1000, 4097]
    g = torch.Generator().manual_seed(0)
    table = (torch.randperm(512, generator=g)[: len(lens) * 70].view(len(lens), 70) * b).long()
    sel = random_selection(lens, h_kv, k_top, b, g)
    seq = torch.tensor(lens)
    indptr = kv_indptr_for(seq, k_top, b, h_kv)
    ref = build_kv_indices(sel, table, seq, b, indptr, torch.zeros(int(indptr[-1]), dtype=torch.int32))
    if dry:  # the Triton kernel in the interpreter on CPU tensors (TRITON_INTERPRET=1)
        from sas_backend.ops.gather.triton import build_kv_indices_triton

        out = build_kv_indices_triton(sel, table, seq, b, indptr, torch.zeros_like(ref))
    else:
        out = gather_kv_indices(sel.to(dev), table.to(dev), seq.to(dev), b, indptr.to(dev),
                                torch.zeros_like(ref, device=dev)).cpu()
    if not torch.equal(out, ref):
        raise AssertionError(f"Triton gather differs from the torch reference at {int((out != ref).sum())} of "
                             f"{ref.numel()} indices")
    return {"kernel": "sas_backend.ops.gather.triton.build_kv_indices_triton", "indices": ref.numel(),
            "interpreted": dry}


def _loader_contract(site: pathlib.Path, record: dict) -> dict:
    """CPU: each recorded URI's JitSpec (FlashInfer's own gen_* via the real call sites) is_aot,
    with aot_path the shipped file; nothing compiled (build raises)."""
    from flashinfer.jit import core

    core.JitSpec.build = lambda self, *a, **k: (_ for _ in ()).throw(AssertionError(f"would compile {self.name}"))
    rec, rows = aot.record_specs()
    want = {m["uri"] for m in record["modules"]}
    got = {r["uri"] for r in rows}
    if want != got:
        raise AssertionError(f"recorded URIs differ from the kit's: missing {sorted(got - want)}, "
                             f"extra {sorted(want - got)}")
    not_aot = [u for u, s in rec.specs.items() if not s.is_aot or pathlib.Path(s.aot_path).resolve()
               != (site / aot.aot_member(u)).resolve()]
    if not_aot:
        raise AssertionError(f"FlashInfer would not load these from the kit: {not_aot}")
    return {"modules": len(got), "resolved_to_site": True}


def check_flashinfer(dry: bool, site: pathlib.Path, record: dict) -> dict:
    if dry:
        try:
            import flashinfer  # noqa: F401
        except Exception as e:
            raise Skip(f"flashinfer does not import here ({type(e).__name__}: {str(e)[:120]})")
        return _loader_contract(site, record)
    import torch

    os.environ["FLASHINFER_DISABLE_JIT"] = "1"  # a module not in the kit raises instead of compiling
    from flashinfer.jit import core

    loaded = []
    orig = core.JitSpec.build_and_load

    def spy(self):
        loaded.append((self.name, self.is_aot))
        return orig(self)

    core.JitSpec.build_and_load = spy
    from sas_backend.ops.gather.torch_path import build_kv_indices, kv_indptr_for
    from sas_backend.ops.sparse_decode.flashinfer import FlashInferSparseDecode
    from sas_backend.ops.sparse_decode.naive import sparse_decode_attention

    results = []
    b, h_kv, k_top = 64, 2, 4
    lens = [1, 65, 300, 1000]
    t0 = time.time()
    for dtype in (torch.bfloat16, torch.float16):
        for d in (64, 128):
            for group in (1, 4):
                g = torch.Generator().manual_seed(d + group)
                slots = 80 * b
                k = torch.randn(slots, h_kv, d, generator=g).to(dtype).cuda()
                v = torch.randn(slots, h_kv, d, generator=g).to(dtype).cuda()
                table = (torch.randperm(slots // b, generator=g)[: len(lens) * 17].view(len(lens), 17) * b).long()
                sel = random_selection(lens, h_kv, k_top, b, g)
                seq = torch.tensor(lens)
                q = torch.randn(len(lens), h_kv * group, d, generator=g).to(dtype).cuda()
                indptr = kv_indptr_for(seq, k_top, b, h_kv)
                idx = build_kv_indices(sel, table, seq, b, indptr, torch.zeros(int(indptr[-1]), dtype=torch.int32))
                ref = sparse_decode_attention(q, k, v, indptr.cuda(), idx.cuda(), d**-0.5)
                fi = FlashInferSparseDecode(h_kv, group, d, dtype, dtype, "cuda", max_rows=16, top_k=k_top,
                                            block_size=b)
                fi.plan(seq, d**-0.5)
                out = fi.run(q, k, v, sel.cuda(), table.cuda(), seq.cuda())
                err = (out.float() - ref.float()).abs().max().item()
                results.append({"dtype": str(dtype).split(".")[-1], "head_dim": d, "group": group,
                                "tensor_cores": fi.use_tensor_cores, "max_abs_err": err})
                if not err <= 2e-2:
                    raise AssertionError(f"FlashInfer sparse decode differs from the reference: {results[-1]}")
    jit = [n for n, is_aot in loaded if not is_aot]
    if jit:
        raise AssertionError(f"modules not from the kit (would JIT-compile): {jit}")
    return {"cases": results, "modules_loaded": sorted({n for n, _ in loaded}), "all_aot": True,
            "seconds": round(time.time() - t0, 1)}


def check_sgl_kernel(dry: bool, site: pathlib.Path) -> dict:
    if not (site / "sgl_kernel").is_dir():
        raise Skip("this kit has no sgl_kernel (FlashInfer-only kit)")
    if dry:
        raise Skip("dry run: sgl_kernel loads CUDA")
    import torch
    import sgl_kernel

    x = torch.randn(37, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    xf = x.float()
    ref = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()).to(x.dtype)
    # sgl_kernel's own sm90 code (the op its rmsnorm wraps), no FlashInfer involved
    own = torch.empty_like(x)
    torch.ops.sgl_kernel.rmsnorm.default(own, x, w, 1e-6, False)
    own_err = (own.float() - ref.float()).abs().max().item()
    if not own_err <= 5e-2:
        raise AssertionError(f"torch.ops.sgl_kernel.rmsnorm differs from torch by {own_err}")
    # The serving path: sgl_kernel.rmsnorm hands bf16/fp16 to FlashInfer's norm module, which the kit does
    # not carry: SGLang's servers JIT-compile it here. Found on the first GPU run (2026-11-27), where the
    # flashinfer check's FLASHINFER_DISABLE_JIT made this raise; compile it now with JIT allowed, timed.
    compiled, seconds = _with_jit_allowed(lambda: sgl_kernel.rmsnorm(x, w, 1e-6))
    out = compiled.pop("result")
    err = (out.float() - ref.float()).abs().max().item()
    if not err <= 5e-2:
        raise AssertionError(f"sgl_kernel.rmsnorm (FlashInfer norm) differs from torch by {err}")
    return {"op": "torch.ops.sgl_kernel.rmsnorm", "max_abs_err": own_err,
            "serving_op": "sgl_kernel.rmsnorm -> flashinfer norm", "serving_max_abs_err": err,
            "jit_compiled": compiled["jit"], "jit_seconds": seconds}


def _with_jit_allowed(fn):
    """Run fn() with FlashInfer's JIT allowed (FLASHINFER_DISABLE_JIT unset for the call, restored after).
    Returns ({"result": fn(), "jit": names of modules built rather than loaded from the kit}, seconds)."""
    from flashinfer.jit import core

    saved = os.environ.pop("FLASHINFER_DISABLE_JIT", None)
    built, orig = [], core.JitSpec.build_and_load

    def spy(self):
        if not self.is_aot:
            built.append(self.name)
        return orig(self)

    core.JitSpec.build_and_load = spy
    t0 = time.time()
    try:
        result = fn()
        import torch

        torch.cuda.synchronize()
    finally:
        core.JitSpec.build_and_load = orig
        if saved is not None:
            os.environ["FLASHINFER_DISABLE_JIT"] = saved
    return {"result": result, "jit": built}, round(time.time() - t0, 1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--site", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--record", default=str(aot.AOT_RECORD), help="the AOT record (gpu_kit/flashinfer-aot.json)")
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)
    site, dry = pathlib.Path(args.site), args.dry_run
    record = json.loads(pathlib.Path(args.record).read_text())
    checks = [("gpu", lambda: check_gpu(dry), ()),
              ("aot", lambda: check_aot(site, record), ()),
              ("toolchain", lambda: check_toolchain(dry), ()),
              ("triton", lambda: check_triton(dry), ("gpu",)),
              ("flashinfer", lambda: check_flashinfer(dry, site, record), ("gpu", "aot")),
              ("sgl_kernel", lambda: check_sgl_kernel(dry, site), ("gpu",))]
    res, failed = {}, False
    for name, fn, needs in checks:
        t0 = time.time()
        blocked = [n for n in needs if res.get(n, {}).get("ok") is False]
        if blocked and not dry:
            res[name] = {"ok": None, "skipped": f"needs {blocked}, which failed"}
        else:
            try:
                res[name] = {"ok": True, **fn()}
            except Skip as e:
                res[name] = {"ok": None, "skipped": str(e)}
            except Exception as e:  # the reason is the result
                res[name] = {"ok": False, "why": f"{type(e).__name__}: {e}"[:1500]}
                failed = True
        res[name]["seconds"] = round(time.time() - t0, 1)
        state = {True: "ok", False: "FAILED", None: "skipped"}[res[name]["ok"]]
        print(f"[tier0] {name}: {state} {res[name].get('why') or res[name].get('skipped') or ''}", flush=True)
    kit.write_json(pathlib.Path(args.out) / "preflight.json", {"checks": res, "ok": not failed, "dry_run": dry})
    lines = ["## Preflight", "", "| check | result | seconds | detail |", "| --- | --- | --- | --- |"]
    for name, r in res.items():
        state = {True: "ok", False: "**FAILED**", None: "skipped"}[r["ok"]]
        detail = r.get("why") or r.get("skipped") or json.dumps({k: v for k, v in r.items()
                                                                 if k not in ("ok", "seconds", "cases")})[:200]
        lines.append(f"| {name} | {state} | {r['seconds']} | {detail.replace('|', '/')} |")
    (pathlib.Path(args.out) / "preflight.md").write_text("\n".join(lines) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
