"""What every benchmark and GPU result records about where it ran, and the Markdown/PNG writers they share.

`environment()` names the device, driver, library versions, the commit and the date; it imports
nothing that needs CUDA, so a dry run on a CPU machine records the same fields (device "none").
The commit comes from `$SAS_COMMIT` when set, else from `git` (sas_backend.provenance; the device
machine receives the working tree without .git, or with a stale one: pass `SAS_COMMIT=$(git rev-parse HEAD)` in the
command); `source_digest` (sha256 over the package's .py files) identifies the code either way.
"""

from __future__ import annotations

import datetime
import hashlib
import importlib
import json
import os
import pathlib
import platform
import subprocess

from sas_backend.paths import source_checkout

# The tree the code came from: this package's checkout, else (the package installed in a GPU kit's site) the
# working directory, the repository root every kit command runs in.
REPO = source_checkout() or pathlib.Path.cwd()
LIBRARIES = ("torch", "triton", "flashinfer", "sglang", "sgl_kernel", "transformers", "sas_backend")


def _version(module: str):
    try:
        return getattr(importlib.import_module(module), "__version__", "unknown")
    except Exception as e:  # noqa: BLE001 - a library that fails to import is itself a finding
        return f"not importable ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})"


def git_commit() -> dict:
    """{"commit", "dirty", "source"}: the package's provenance helper on this checkout (git, else
    $SAS_COMMIT), and which of the two answered."""
    from sas_backend.provenance import git_state

    return {**git_state(REPO), "source": "$SAS_COMMIT" if os.environ.get("SAS_COMMIT") else "git"}


def source_digest() -> str:
    """sha256 over the paths and bytes of sas_backend/**/*.py, in sorted order."""
    h = hashlib.sha256()
    for p in sorted((REPO / "sas_backend").rglob("*.py")):
        h.update(str(p.relative_to(REPO)).encode())
        h.update(p.read_bytes())
    return h.hexdigest()


def device_info() -> dict:
    """GPU name, driver, CUDA runtime, memory and SM count; {"device": "none"} without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return {"device": "none (no CUDA here)", "driver": None, "cuda": torch.version.cuda}
    props = torch.cuda.get_device_properties(0)
    driver = None
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=20).stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        pass
    return {"device": props.name, "driver": driver, "cuda": torch.version.cuda,
            "memory_gib": round(props.total_memory / 2**30, 1), "sms": props.multi_processor_count,
            "capability": f"{props.major}.{props.minor}"}


def environment() -> dict:
    """Everything a result file records about where and from what it was made."""
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **device_info(),
        "python": platform.python_version(),
        "versions": {m: _version(m) for m in LIBRARIES},
        "git": git_commit(),
        "source_digest": source_digest(),
        "host": platform.platform(),
    }


def env_markdown(env: dict) -> str:
    """The environment as a short Markdown list."""
    v = env["versions"]
    lines = [
        f"- device: {env['device']}; driver {env.get('driver')}; CUDA {env.get('cuda')}",
        f"- date: {env['date']}; commit {env['git']['commit']} ({env['git']['source']}); "
        f"source digest {env['source_digest'][:16]}",
        "- versions: " + ", ".join(f"{k} {v.get(k)}" for k in LIBRARIES),
    ]
    return "\n".join(lines)


def md_table(header: list, rows: list) -> str:
    """A Markdown table; numbers get 3 significant decimals."""
    def cell(x):
        if isinstance(x, float):
            return f"{x:.3g}" if abs(x) < 1000 else f"{x:.0f}"
        return str(x)

    out = ["| " + " | ".join(header) + " |", "|" + " ---: |" * len(header)]
    out += ["| " + " | ".join(cell(x) for x in r) + " |" for r in rows]
    return "\n".join(out)


def write_atomic(path, text: str) -> None:
    """Write `text` to `path` whole or not at all (a temporary file beside it, then os.replace): a benchmark
    rewrites its record after every point, and a step killed mid-write must leave the previous record."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_json_atomic(path, obj) -> None:
    """`obj` as indented JSON with a trailing newline, written by `write_atomic`."""
    write_atomic(path, json.dumps(obj, indent=2, default=str) + "\n")


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None where matplotlib is missing (the GPU image
    has it; without it the JSON and Markdown are still written, only the PNG is not)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def parse_points(specs) -> list:
    """`[(context, batch)]` from `CONTEXTxBATCH` strings (`8192x1`); ValueError on anything else. The benchmarks'
    `--points` (bench/bench_decode.py, gpu_kit/bench_decode_step.py)."""
    points = []
    for spec in specs:
        parts = spec.lower().split("x")
        if len(parts) != 2:
            raise ValueError(f"{spec!r} is not CONTEXTxBATCH")
        points.append((int(parts[0]), int(parts[1])))
    return points
