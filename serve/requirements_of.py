"""The requirement lines serve/install.sh's CPU recipe hands to pip, read from installed packages' metadata.

    python serve/requirements_of.py sglang                       # SGLang's, minus extras and CUDA-only packages
    python serve/requirements_of.py sas-backend --extras test,train   # what those extras of ours add

One requirement a line. SGLang is installed `--no-deps` on CPU (its metadata pins CUDA-only packages that do not
install without NVIDIA's index), so its own requirements are installed from this list instead. An extra's
requirement keeps its own extras (`lm-eval[api,ruler]`: without them lm-eval lacks its API client and RULER's
packages) and loses only its `extra == ...` marker.
"""

from __future__ import annotations

import argparse
import re
from importlib.metadata import requires

from packaging.requirements import Requirement

# Installed with the GPU stack or not at all on CPU; torch is held by install.sh's constraints file.
CUDA_ONLY = re.compile(
    r"^(cuda-python|cuda-tile|flash-attn-4|flashinfer.*|humming-kernels|nvidia-.*|nvshmem4py.*"
    r"|quack-kernels|sgl-deep-ep|sgl-deep-gemm|sgl-flash-mla|sglang-kernel|tilelang"
    r"|torch-memory-saver|torch_memory_saver|torchaudio|torchcodec|tokenspeed.mla|torch)$",
    re.I,
)


def sglang_cpu_requirements(lines: list[str]) -> list[str]:
    """SGLang's Requires-Dist `lines` that a CPU install needs: no extras' requirements, no markers that do
    not apply here, no CUDA-only package; each as `name specifier`, without its own extras (the ones SGLang
    names are CUDA builds' `[cu13]`, and this list has installed a working CPU server without them)."""
    out = []
    for line in lines:
        r = Requirement(line)
        if r.marker is not None and not r.marker.evaluate({"extra": ""}):
            continue
        if CUDA_ONLY.match(r.name):
            continue
        out.append(str(Requirement(f"{r.name}{r.specifier}")))
    return out


def extra_requirements(lines: list[str], extras: set[str]) -> list[str]:
    """The Requires-Dist `lines` that one of `extras` adds, each with its own extras and without its marker."""
    out = []
    for line in lines:
        r = Requirement(line)
        if r.marker is not None and any(r.marker.evaluate({"extra": e}) for e in extras):
            r.marker = None
            out.append(str(r))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("package", choices=["sglang", "sas-backend"])
    ap.add_argument("--extras", default="", help="comma-separated extras of sas-backend")
    args = ap.parse_args(argv)
    lines = requires(args.package) or []
    if args.package == "sglang":
        reqs = sglang_cpu_requirements(lines)
    else:
        reqs = extra_requirements(lines, {e for e in args.extras.split(",") if e})
    print("\n".join(reqs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
