"""Build the GPU kit from PyPI: SGLang's minimal serving set as one xz archive, FlashInfer's wheels,
FlashInfer's modules pre-built for sm90a, SHA256SUMS and a manifest. Runs on any x86-64 machine with
network (wheels are fetched for the GPU host's CPython 3.12, not this interpreter's) or offline from
a local wheel folder (`--find-links`) and an existing site archive (`--restage`).

    # tiers 0 and 2 (.whl/site): the shared kit's site, slimmed, import-checked, + the AOT modules
    python gpu_kit/build_kit.py --out .whl/site --restage ../shared/gpu-kit/sglang-0.5.15-h100-site.tar.xz \
        --keep build/kit-stage --import-check --find-links ../shared/gpu-kit --aot --jobs 2
    # tier 1 (.whl/fi): the two FlashInfer wheels + the same AOT archive
    python gpu_kit/build_kit.py --out .whl/fi --flashinfer-only --find-links ../shared/gpu-kit --aot
    # from PyPI instead (~0.75 GB download), diffed against a kit
    python gpu_kit/build_kit.py --out .whl/site --keep build/kit-stage --import-check --aot \
        --compare ../shared/gpu-kit

Each run updates gpu_kit/kit-record.json (this kit's files, sha256s and the payload per tier:
the repository's tracked files + the kit directory, >= HEADROOM_MIB free under the device tool's 64 MiB);
`--aot` also writes gpu_kit/flashinfer-aot.json.

Steps: (1) `pip download --no-deps --only-binary=:all:` of every `name-version` in
gpu_kit/site-contents.txt (the shared kit's list) or `--packages`, for cp312 manylinux x86-64;
(2) `pip install --no-deps --no-index --target STAGE` of those wheels (same target tags);
(3) what names the build machine goes (pip's direct_url.json records, the interpreter path in
bin/ scripts' shebangs); slimming (SLIM below: sglang-kernel to its sm90 ops without FA3/FlashMLA, xgrammar's static
library dropped and its shared objects stripped of debug info, tokenizers' too; RECORD lines of
removed files dropped); (4) STAGE packed into
`sglang-<version>-h100-site.tar.xz` (or `site.tar.xz` without sglang) with sorted members, fixed
owners and mtimes; (5) the FlashInfer wheels copied beside it; (6) `SHA256SUMS` and
`manifest.json` (package, version, wheel file, sha256 and size of each wheel; the archive's sha256,
size, unpacked size and file count; the slimming applied; the command).
`--compare KIT` lists the files only in one of the two archives and the size differences.
`--import-check` (with `--keep`) runs gpu_kit/import_check.py on the slimmed site and on the site
as it was before slimming and fails the build (exit 1) if the slimmed one breaks SGLang's serving
imports or lost anything the full one had. `--aot` compiles FlashInfer's modules (gpu_kit/aot.py;
reused from `--aot-cache`, progress in <aot-cache>/build.log) and packs them beside the site.
"""

from __future__ import annotations

import argparse
import datetime
import fnmatch
import json
import lzma
import os
import pathlib
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time

import aot  # noqa: E402
import kit  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
CONTENTS = HERE / "site-contents.txt"
PYTHON_VERSION, PLATFORMS, target_args = kit.PYTHON_VERSION, kit.PLATFORMS, kit.target_args
FLASHINFER_ONLY = ["flashinfer_python-0.6.12", "apache_tvm_ffi-0.1.11"]
FIXED_MTIME = 1700000000  # archive members' mtime (reproducible archives)

# What the kit does not carry, by package: paths (fnmatch against site-relative POSIX paths) to
# delete, directories to prune down to a keep-list (every entry directly under "dir" whose name
# matches no "keep" pattern goes), shared objects to strip of debug info, and fat binaries whose
# GPU code for other architectures is zeroed (FATBIN_KEEP_SM; the bytes stay, so the ELF layout
# does not change, and xz packs the zeros to nothing). sglang-kernel: Hopper (sm90) common ops only,
# so SGLang must be told `--attention-backend flashinfer` (it would pick FA3 on Hopper).
#
# Why each of the later rules is safe: gpu_kit/import_check.py (faked H100, `--import-check`)
# imports SGLang's serving path, builds its model registry and resolves Llama/Qwen2/Qwen3 on the
# full and the slimmed site and finds nothing lost; none of these imports sglang.multimodal_gen
# (diffusion serving) or sglang.srt.grpc (the gRPC server, a 7 MiB compiled module). The model
# registry imports every file in sglang/srt/models at startup, and those import most of
# transformers' model folders (156 of them); the keep-lists below were tried and FAILED the import
# check (see PRUNE_MODELS), so both model folders travel whole. The FlashInfer attention modules
# (fa2 decode/prefill, JIT fallback) include no CUTLASS header (their ninja dependency lists), so
# CUTLASS's headers go too: a JIT build of FA3/GEMM/MoE modules would then fail on the host (the
# tiers load none).
SGLANG_MODELS_KEEP = ["__init__.py", "registry.py", "utils.py", "llama.py", "qwen2.py", "qwen3.py", "transformers.py"]
TRANSFORMERS_MODELS_KEEP = ["__init__.py", "auto", "llama", "qwen2", "qwen3", "gpt2"]
PRUNE_MODELS = {"sglang": [{"dir": "sglang/srt/models", "keep": SGLANG_MODELS_KEEP}],
                "transformers": [{"dir": "transformers/models", "keep": TRANSFORMERS_MODELS_KEEP}]}
FATBIN_KEEP_SM = (90,)  # H100/H200
SLIM = {
    "sglang_kernel": {
        "remove": ["sgl_kernel/sm100", "sgl_kernel/sm100/*", "sgl_kernel/*/flash_ops*.so", "sgl_kernel/flash_ops*.so",
                   "sgl_kernel/*/flashmla_ops*.so", "sgl_kernel/flashmla_ops*.so"],
        "strip": [],
        "fatbin": ["sgl_kernel/sm90/common_ops*.so"],
    },
    "sglang": {"remove": ["sglang/multimodal_gen", "sglang/srt/grpc"]},
    # Not applied (PRUNE_MODELS): cutting sglang/srt/models and transformers/models to the keep-lists above
    # broke the import check (transformers' AutoProcessor imports model folders beyond these), and the
    # kit fits without it.
    "flashinfer_python": {"remove": ["flashinfer/data/cutlass"]},
    "xgrammar": {"remove": ["xgrammar/*.a", "xgrammar/*/*.a", "xgrammar/*/*/*.a"],
                 "strip": ["xgrammar/*.so", "xgrammar/*/*.so"]},
    "tokenizers": {"remove": [], "strip": ["tokenizers/*.so"]},  # -0.2 MiB; the shared kit did the same
}
PORTABLE_SHEBANG = "#!/usr/bin/env python3"


def parse_spec(spec: str) -> tuple:
    """'name-1.2.3' or 'name==1.2.3' -> ('name', '1.2.3'); names keep their underscores."""
    if "==" in spec:
        name, version = spec.split("==", 1)
    else:
        name, _, version = spec.strip().rpartition("-")
    if not name or not version:
        raise ValueError(f"not a name-version pin: {spec!r}")
    return name.strip(), version.strip()


def read_contents(path: pathlib.Path) -> list:
    """The pins in a site-contents file (one `name-version` per line)."""
    return [parse_spec(line) for line in pathlib.Path(path).read_text().splitlines() if line.strip()]


def _norm(name: str) -> str:
    return name.lower().replace("-", "_").replace(".", "_")


def pip(args, python=sys.executable) -> None:
    """Run pip with args; raise with its output on failure."""
    cmd = [python, "-m", "pip", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise kit.KitError(f"pip failed: {' '.join(cmd)}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")


def download(pins, dest: pathlib.Path, find_links=None, python_version=PYTHON_VERSION) -> dict:
    """Fetch one wheel per pin into dest; returns {normalized name: wheel path}. find_links: a local
    wheel directory to use instead of any index (offline builds and tests)."""
    dest.mkdir(parents=True, exist_ok=True)
    source = ["--no-index", "--find-links", str(find_links)] if find_links else []
    pip(["download", "-q", "--no-deps", *source, *target_args(python_version), "-d", str(dest),
         *[f"{n}=={v}" for n, v in pins]])
    wheels = {}
    for w in dest.glob("*.whl"):
        wheels[_norm(w.name.split("-")[0])] = w
    missing = [n for n, _ in pins if _norm(n) not in wheels]
    if missing:
        raise kit.KitError(f"no wheel downloaded for {missing}")
    return {_norm(n): wheels[_norm(n)] for n, _ in pins}


def install(wheels, stage: pathlib.Path, python_version=PYTHON_VERSION) -> None:
    """`pip install --no-deps --no-index --target stage` for the GPU host's tags."""
    pip(["install", "-q", "--no-deps", "--no-index", "--no-compile", *target_args(python_version),
         "--target", str(stage), *map(str, wheels)])


def drop_record_lines(stage: pathlib.Path, removed) -> None:
    """Remove the RECORD lines of files that are no longer in stage (`removed`: site-relative
    POSIX paths; a directory drops everything under it), so RECORD lists what the kit holds."""
    removed = list(removed)
    if not removed:
        return
    for record in stage.glob("*.dist-info/RECORD"):
        lines = record.read_text().splitlines()
        keep = [ln for ln in lines if not any(ln.startswith((f"{r},", f"{r}/")) for r in removed)]
        if len(keep) != len(lines):
            record.write_text("\n".join(keep) + "\n")


def make_portable(stage: pathlib.Path) -> dict:
    """Take out what names the build machine: pip's `*.dist-info/direct_url.json` (the download
    directory; also made archives differ between builds) and the interpreter path in bin/ scripts'
    shebangs (set to `#!/usr/bin/env python3`). Returns counts."""
    urls = [u.relative_to(stage).as_posix() for u in stage.glob("*.dist-info/direct_url.json")]
    for u in urls:
        (stage / u).unlink()
    drop_record_lines(stage, urls)
    scripts = 0
    for script in sorted((stage / "bin").glob("*")) if (stage / "bin").is_dir() else []:
        data = script.read_bytes()
        if data.startswith(b"#!") and b"python" in data.split(b"\n", 1)[0]:
            script.write_bytes(PORTABLE_SHEBANG.encode() + data[data.index(b"\n"):])
            scripts += 1
    return {"direct_url_dropped": len(urls), "shebangs_rewritten": scripts}


def _matches(rel: str, patterns) -> bool:
    return any(fnmatch.fnmatch(rel, p) for p in patterns)


def fatbin_entries(data: bytes):
    """(offset, size, kind, sm) of each image in a CUDA fat binary section (`.nv_fatbin`): blobs of
    a 16-byte header (magic 0xBA55ED50, version, header size, payload size) followed by entries
    (kind 1 PTX / 2 ELF, header size, image size, ..., sm at +28)."""
    import struct

    pos, out = 0, []
    while pos + 16 <= len(data):
        magic, _, hsize, fsize = struct.unpack_from("<IHHQ", data, pos)
        if magic != 0xBA55ED50:
            pos += 8
            continue
        e, end = pos + hsize, pos + hsize + fsize
        while e + 32 <= end:
            kind, _, ehs, esz = struct.unpack_from("<HHIQ", data, e)
            sm = struct.unpack_from("<I", data, e + 28)[0]
            out.append((e + ehs, esz, kind, sm))
            e += ehs + esz
        pos = end
    return out


def prune_fatbin(path: pathlib.Path, keep_sm=FATBIN_KEEP_SM) -> dict:
    """Zero the GPU images in `path`'s .nv_fatbin whose SM is not in keep_sm (cubins for other GPUs,
    which a Hopper never loads; the CUDA driver picks the image matching the device). Sizes and
    offsets do not change. Returns {"zeroed_bytes", "kept_bytes", "by_sm": {sm: bytes}}."""
    proc = subprocess.run(["readelf", "-S", "-W", str(path)], capture_output=True, text=True)
    out = proc.stdout if proc.returncode == 0 else ""  # not an ELF file: nothing to prune
    sect = None
    for line in out.splitlines():
        if " .nv_fatbin " in line:
            f = line.split("]", 1)[1].split()
            sect = (int(f[3], 16), int(f[4], 16))
    if sect is None:
        return {"zeroed_bytes": 0, "kept_bytes": 0, "by_sm": {}}
    data = bytearray(path.read_bytes())
    off, size = sect
    zeroed = kept = 0
    by_sm = {}
    for start, n, kind, sm in fatbin_entries(bytes(data[off:off + size])):
        by_sm[sm] = by_sm.get(sm, 0) + n
        if sm in keep_sm or kind not in (1, 2):
            kept += n
            continue
        data[off + start:off + start + n] = bytes(n)
        zeroed += n
    path.write_bytes(bytes(data))
    return {"zeroed_bytes": zeroed, "kept_bytes": kept, "by_sm": by_sm}


def slim(stage: pathlib.Path, packages, rules=None) -> dict:
    """Apply the slimming rules of the packages present; returns {package: {"removed": [...],
    "stripped": [...], "fatbin": {...}, "bytes_saved": n}}. Stripping needs binutils' `strip`
    (skipped without it), fat-binary pruning binutils' `readelf`."""
    rules = SLIM if rules is None else rules
    report = {}
    files = sorted(p for p in stage.rglob("*"))
    for pkg in packages:
        rule = rules.get(_norm(pkg))
        if not rule:
            continue
        removed, stripped, saved = [], [], 0

        def drop(p, rel):
            nonlocal saved
            size = sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) if p.is_dir() else p.stat().st_size
            shutil.rmtree(p) if p.is_dir() else p.unlink()
            removed.append(rel)
            saved += size

        for p in files:
            rel = p.relative_to(stage).as_posix()
            if p.exists() and _matches(rel, rule.get("remove", [])):
                drop(p, rel)
        for pr in rule.get("prune", []):
            d = stage / pr["dir"]
            for p in sorted(d.iterdir()) if d.is_dir() else []:
                if not any(fnmatch.fnmatch(p.name, k) for k in pr["keep"]):
                    drop(p, p.relative_to(stage).as_posix())
        strip = shutil.which("strip")
        for p in files:
            rel = p.relative_to(stage).as_posix()
            if strip and p.is_file() and _matches(rel, rule.get("strip", [])):
                before = p.stat().st_size
                subprocess.run([strip, "--strip-debug", str(p)], check=True)
                saved += before - p.stat().st_size
                stripped.append(rel)
        fatbins = {}
        for p in files:
            rel = p.relative_to(stage).as_posix()
            if p.is_file() and _matches(rel, rule.get("fatbin", [])):
                fatbins[rel] = prune_fatbin(p)
        drop_record_lines(stage, removed)
        report[_norm(pkg)] = {"removed": removed, "stripped": stripped, "bytes_saved": saved}
        if fatbins:
            report[_norm(pkg)]["fatbin_zeroed"] = fatbins
    return report


def pack(stage: pathlib.Path, archive: pathlib.Path, preset: int = 9) -> dict:
    """tar.xz of stage's contents (sorted, root-owned, fixed mtime); {"files", "unpacked_bytes"}."""
    files = unpacked = 0

    def norm(ti: tarfile.TarInfo) -> tarfile.TarInfo:
        ti.uid = ti.gid = 0
        ti.uname = ti.gname = "root"
        ti.mtime = FIXED_MTIME
        return ti

    tmp = archive.with_suffix(".tmp")
    with (lzma.open(tmp, "wb", preset=preset) as xz,
          tarfile.open(fileobj=xz, mode="w", format=tarfile.PAX_FORMAT) as tar):
        tar.add(stage, arcname=".", recursive=False, filter=norm)
        for p in sorted(stage.rglob("*")):
            if p.is_symlink():  # a carried link arrives as a link: refuse to pack one
                raise kit.KitError(f"{p} is a symbolic link; the kit must hold real files")
            tar.add(p, arcname="./" + p.relative_to(stage).as_posix(), recursive=False, filter=norm)
            if p.is_file():
                files += 1
                unpacked += p.stat().st_size
    os.replace(tmp, archive)
    return {"files": files, "unpacked_bytes": unpacked}


def archive_listing(archive: pathlib.Path) -> dict:
    """{member path: size} of the regular files in a tar archive (leading './' dropped)."""
    with tarfile.open(archive) as tar:
        return {m.name.removeprefix("./"): m.size for m in tar.getmembers() if m.isfile()}


def compare(mine: pathlib.Path, theirs: pathlib.Path) -> dict:
    """Files only in one archive, files whose sizes differ, and both totals (sizes in bytes)."""
    a, b = archive_listing(mine), archive_listing(theirs)
    only_a, only_b = sorted(set(a) - set(b)), sorted(set(b) - set(a))
    differ = sorted(k for k in set(a) & set(b) if a[k] != b[k])
    # pyc/RECORD noise aside, group by top-level directory so the report stays short
    def top(names):
        out = {}
        for n in names:
            out[n.split("/")[0]] = out.get(n.split("/")[0], 0) + 1
        return out

    return {
        "mine": {"archive_bytes": mine.stat().st_size, "files": len(a), "unpacked_bytes": sum(a.values())},
        "theirs": {"archive_bytes": theirs.stat().st_size, "files": len(b), "unpacked_bytes": sum(b.values())},
        "only_mine": top(only_a), "only_theirs": top(only_b),
        "only_mine_files": only_a[:200], "only_theirs_files": only_b[:200],
        "size_differs": len(differ), "size_differs_files": differ[:100],
    }


def _same_wheels(manifest: dict, kit_dir: pathlib.Path) -> dict:
    """{wheel: True/False/None} whether each carried wheel's sha256 equals the one in kit_dir's
    SHA256SUMS (None: not listed there)."""
    theirs = kit.read_sums(kit_dir)
    return {p["wheel"]: (theirs[p["wheel"]] == p["sha256"]) if p["wheel"] in theirs else None
            for p in manifest["packages"] if p["wheel"] in manifest["flashinfer_wheels"]}


def stage_from_archive(archive: pathlib.Path, stage: pathlib.Path) -> dict:
    """The stage from an existing site archive (e.g. the shared kit's) instead of PyPI: the same
    slimming then applies to it. Returns {"name", "sha256", "bytes"} of the source archive."""
    kit.unpack(archive, stage)
    return {"name": archive.name, "sha256": kit.sha256_of(archive), "bytes": archive.stat().st_size}


def build(pins, out: pathlib.Path, find_links=None, preset=9, keep=None, command=None, restage=None,
          keep_full: bool = False) -> dict:
    """Download, install, slim, pack; write SHA256SUMS and manifest.json into out. Returns the manifest.
    restage: a site archive to start from instead of downloading and installing `pins`.
    keep_full (with keep): also leave the site as it was before slimming in `keep/site-full`, for
    the import check's comparison (`import_check.compare`)."""
    out.mkdir(parents=True, exist_ok=True)
    work = pathlib.Path(keep) if keep else pathlib.Path(tempfile.mkdtemp(prefix="sas-kit-"))
    try:
        stage = work / "site"
        for d in (stage, work / "site-full"):
            if d.exists():
                shutil.rmtree(d)
        if restage:
            source = stage_from_archive(pathlib.Path(restage), stage)
            found = kit.installed_versions(stage, [n for n, _ in pins])
            pins = [(n, found[n]) for n, _ in pins if found.get(n)]
            wheels = {}
        else:
            source = None
            wheels = download(pins, work / "wheels", find_links)
            install(list(wheels.values()), stage)
        portable = make_portable(stage)
        # FlashInfer alone travels as its two wheels (tier 1), as published: nothing to slim or pack.
        wheels_only = {_norm(n) for n, _ in pins} <= {"flashinfer_python", "apache_tvm_ffi"}
        if keep and keep_full and not wheels_only:  # a real copy: slimming rewrites some files in place
            shutil.copytree(stage, work / "site-full", symlinks=True)
        slimmed = {} if wheels_only else slim(stage, [n for n, _ in pins])
        versions = dict(pins)
        sglang = next((v for n, v in pins if _norm(n) == "sglang"), None)
        name = f"sglang-{sglang}-h100-site.tar.xz" if sglang else "site.tar.xz"
        archive = out / name
        packed = {} if wheels_only else pack(stage, archive, preset)
        carried = []  # the site archive holds FlashInfer already: its wheels travel only in a wheels-only kit
        for n in ("flashinfer_python", "apache_tvm_ffi") if wheels_only else ():
            if n in wheels:
                shutil.copy(wheels[n], out / wheels[n].name)
                carried.append(wheels[n].name)
        manifest = {
            "built": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": command, "python": PYTHON_VERSION, "platforms": PLATFORMS,
            "packages": [{"name": n, "version": versions[n], "wheel": wheels[_norm(n)].name,
                          "sha256": kit.sha256_of(wheels[_norm(n)]), "bytes": wheels[_norm(n)].stat().st_size}
                         if _norm(n) in wheels else {"name": n, "version": versions[n]} for n, _ in pins],
            "restaged_from": source,
            "archive": None if wheels_only else {"name": name, "sha256": kit.sha256_of(archive),
                                                 "bytes": archive.stat().st_size, "xz_preset": preset, **packed},
            "flashinfer_wheels": carried,
            "slimmed": slimmed, "made_portable": portable,
        }
        sums = [] if wheels_only else [f"{manifest['archive']['sha256']}  {name}"]
        sums += [f"{p['sha256']}  {p['wheel']}" for p in manifest["packages"] if p.get("wheel") in carried]
        (out / kit.SUMS_FILE).write_text("\n".join(sums) + "\n")
        kit.write_json(out / kit.MANIFEST_FILE, manifest)
        return manifest
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)


# ------------------------------------------------------------------------------ AOT FlashInfer
def stub_libcuda(shim: pathlib.Path) -> pathlib.Path:
    """For linking on a machine without a driver: `shim/libcuda.so` is a linker script
    `INPUT(AS_NEEDED(shim/libcuda.so.1))` over an empty stub with that soname, so FlashInfer's
    `-lcuda` resolves and a module records libcuda.so.1 as needed only if it calls the driver API."""
    shim.mkdir(parents=True, exist_ok=True)
    src = shim / "empty.c"
    src.write_text("/* stub: no symbols */\n")
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(shim / "libcuda.so.1"), "-Wl,-soname,libcuda.so.1", str(src)],
                   check=True)
    (shim / "libcuda.so").write_text(f"INPUT(AS_NEEDED({shim / 'libcuda.so.1'}))\n")
    return shim


def flashinfer_scratch(work: pathlib.Path, wheel: pathlib.Path) -> list:
    """A `--target` install of the FlashInfer wheel for THIS interpreter (its code is pure Python),
    plus nvidia-ml-py (`pynvml`, which the GPU image has) and, if this interpreter cannot import the
    kit's cp312 apache-tvm-ffi, that version built for this one. Returns the PYTHONPATH entries."""
    site = work / "fi-site"
    if not (site / "flashinfer").is_dir():
        pip(["install", "-q", "--no-deps", "--no-index", "--no-compile", "--target", str(site), str(wheel)])
    extra = work / "fi-deps"
    need = []
    import importlib.util

    if importlib.util.find_spec("pynvml") is None and not (extra / "pynvml.py").exists():
        need.append("nvidia-ml-py")
    if importlib.util.find_spec("tvm_ffi") is None and not (extra / "tvm_ffi").is_dir():
        need.append("apache-tvm-ffi==0.1.11")
    if need:
        pip(["install", "-q", "--no-deps", "--no-compile", "--target", str(extra), *need])
    return [str(site), str(extra)]


def aot_worker_env(paths, cache: pathlib.Path, jobs: int) -> dict:
    """Environment of the AOT worker: FlashInfer from the scratch install, this machine's CUDA
    toolkit (the real one, not a wrapper's folder), Hopper only, the libcuda stub for linking."""
    cuda = kit.find_cuda_home()
    if not cuda["cuda_home"]:
        raise kit.KitError("no CUDA toolkit (nvcc + headers) found: set CUDA_HOME")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([*paths, str(kit.REPO)]),
               FLASHINFER_WORKSPACE_BASE=str(cache / "ws"), FLASHINFER_CUDA_ARCH_LIST=aot.ARCH_LIST,
               CUDA_HOME=cuda["cuda_home"], MAX_JOBS=str(jobs),
               PATH=os.pathsep.join([os.path.dirname(sys.executable), str(pathlib.Path(cuda["cuda_home"]) / "bin"),
                                     os.environ.get("PATH", "")]))
    shim = kit.link_shim(cuda["cuda_home"], cache / "shim")
    if not shim["libcuda"]:
        stub_libcuda(cache / "shim")
        shim["env"] = {"FLASHINFER_EXTRA_LDFLAGS": f"-L{cache / 'shim'}"}
    env.update(shim["env"])
    return env


def nvcc_version(env) -> str:
    out = subprocess.run([str(pathlib.Path(env["CUDA_HOME"]) / "bin" / "nvcc"), "--version"], capture_output=True,
                         text=True).stdout
    return next((ln.strip() for ln in out.splitlines() if "release" in ln), out.strip()[-80:])


def add_aot(out: pathlib.Path, wheel: pathlib.Path, cache: pathlib.Path, jobs: int = 1, preset: int = 9,
            command=None, record_path: pathlib.Path | None = aot.AOT_RECORD, status_only: bool = False) -> dict:
    """Compile FlashInfer's modules for the tiers (gpu_kit/aot.py; modules already in
    cache/aot are reused), pack them as `flashinfer-aot-*.tar.xz` into `out` (site-relative members
    flashinfer/data/aot/<uri>/<uri>.so), add it to out's SHA256SUMS and manifest.json, and write the
    record (`record_path`: gpu_kit/flashinfer-aot.json by default). Returns the record."""
    cache = pathlib.Path(cache).resolve()
    cache.mkdir(parents=True, exist_ok=True)
    env = aot_worker_env(flashinfer_scratch(cache, wheel), cache, jobs)
    t0 = time.time()
    lines = []
    with open(cache / "build.log", "a") as log:  # progress of a long build: tail -f <cache>/build.log
        proc = subprocess.Popen([sys.executable, str(HERE / "aot.py"), "build", "--out", str(cache),
                                 *(["--status"] if status_only else [])], env=env, cwd=cache,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:
            lines.append(line)
            if not line.startswith("AOT "):
                log.write(line)
                log.flush()
        proc.wait()
    rows = next((json.loads(ln[4:]) for ln in lines if ln.startswith("AOT ")), None)
    if proc.returncode != 0 or rows is None:
        raise kit.KitError("AOT build failed:\n" + "".join(lines)[-8000:])
    if not all(r["built"] for r in rows):  # --aot-status on a build still running: record, pack nothing
        record = {"built": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  "command": command, "flashinfer": aot.FLASHINFER_VERSION, "arch_list": aot.ARCH_LIST,
                  "nvcc": nvcc_version(env), "complete": False, "modules": rows, "archive": None,
                  "build_minutes_total": round(sum(r.get("build_seconds") or 0 for r in rows) / 60, 1)}
        if record_path:
            kit.write_json(record_path, record)
        return record
    stage = cache / "stage"
    if stage.exists():
        shutil.rmtree(stage)
    for r in rows:
        dest = stage / r["member"]
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(cache / "aot" / r["uri"] / f"{r['uri']}.so", dest)
    archive = pathlib.Path(out) / aot.AOT_ARCHIVE
    packed = pack(stage, archive, preset)
    record = {
        "built": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command, "flashinfer": aot.FLASHINFER_VERSION, "arch_list": aot.ARCH_LIST, "nvcc": nvcc_version(env),
        "link": ("libcuda stub (linker script AS_NEEDED over an empty libcuda.so.1)"
                 if "shim" in env.get("FLASHINFER_EXTRA_LDFLAGS", "") else "toolkit libcuda"),
        "complete": True, "modules": rows,
        "build_minutes_total": round(sum(r.get("build_seconds") or 0 for r in rows) / 60, 1),
        "wall_minutes_this_run": round((time.time() - t0) / 60, 1),
        "archive": {"name": archive.name, "sha256": kit.sha256_of(archive), "bytes": archive.stat().st_size, **packed},
    }
    sums = kit.read_sums(out)
    sums[archive.name] = record["archive"]["sha256"]
    (pathlib.Path(out) / kit.SUMS_FILE).write_text("".join(f"{v}  {k}\n" for k, v in sums.items()))
    mpath = pathlib.Path(out) / kit.MANIFEST_FILE
    manifest = json.loads(mpath.read_text()) if mpath.exists() else {}
    manifest["aot"] = {k: record[k] for k in ("flashinfer", "arch_list", "nvcc", "archive", "build_minutes_total")}
    manifest["aot"]["uris"] = [r["uri"] for r in rows]
    kit.write_json(mpath, manifest)
    if record_path:
        kit.write_json(record_path, record)
    return record


# ---------------------------------------------------------------------------------- payload
CARRY_LIMIT_MIB = 64.0
# The project kept 10 MiB free until 2026-11-26, when the second model's gate (7.5 MiB, fp16) took most of it:
# tier 2 now carries ~60.7 MiB. 2 MiB still leaves room for a results commit; storing the default model's gate
# in fp16 too (8.5 MiB back) restores the 10 MiB rule (issue 22's note).
HEADROOM_MIB = 2.0
KIT_RECORD = HERE / "kit-record.json"  # committed: the payload of the last kit builds, per tier
MIB = 2**20


def repo_bytes(repo: pathlib.Path = kit.REPO) -> dict:
    """Bytes of what a device call sends of the repository: tracked files plus untracked files
    git does not ignore (`git ls-files`); the device tool counts these against its 64 MiB."""
    def listed(*args):
        out = subprocess.run(["git", "ls-files", "-z", *args], cwd=repo, capture_output=True, check=True).stdout
        return [repo / p.decode() for p in out.split(b"\0") if p]

    tracked = [p for p in listed() if p.is_file() and not p.is_symlink()]
    untracked = [p for p in listed("--others", "--exclude-standard") if p.is_file() and not p.is_symlink()]
    return {"tracked": sum(p.stat().st_size for p in tracked), "untracked": sum(p.stat().st_size for p in untracked)}


def kit_files(kit_dir: pathlib.Path) -> dict:
    """{file name: bytes} of what a `carry` of kit_dir sends (its plain files; the kit is flat)."""
    return {p.name: p.stat().st_size for p in sorted(pathlib.Path(kit_dir).iterdir()) if p.is_file()}


def payload(kit_dir: pathlib.Path, repo: pathlib.Path = kit.REPO) -> dict:
    """MiB a tier's device call carries: the repository (`repo_bytes`) plus every file in the
    kit directory; the headroom left under the 64 MiB limit, and whether it is >= HEADROOM_MIB.
    total_mib counts the untracked files of this checkout too (what a call from here would send);
    committed_mib only the tracked ones (what a call from a clean checkout sends)."""
    r = repo_bytes(repo)
    files = kit_files(kit_dir)
    total = r["tracked"] + r["untracked"] + sum(files.values())
    committed = r["tracked"] + sum(files.values())
    return {"repo_tracked_mib": round(r["tracked"] / MIB, 2), "repo_untracked_mib": round(r["untracked"] / MIB, 2),
            "kit_files_mib": {k: round(v / MIB, 2) for k, v in files.items()},
            "kit_mib": round(sum(files.values()) / MIB, 2), "total_mib": round(total / MIB, 2),
            "committed_mib": round(committed / MIB, 2),
            "limit_mib": CARRY_LIMIT_MIB, "headroom_mib": round(CARRY_LIMIT_MIB - total / MIB, 2),
            "headroom_committed_mib": round(CARRY_LIMIT_MIB - committed / MIB, 2),
            "headroom_ok": CARRY_LIMIT_MIB - total / MIB >= HEADROOM_MIB}


def portable(text: str) -> str:
    """A command or path with this checkout's location made relative (a committed record names
    no machine path): <repo>/x -> x, <repo's parent>/y -> ../y."""
    repo = str(kit.REPO)
    return (str(text).replace(repo + os.sep, "").replace(repo, ".")
            .replace(str(kit.REPO.parent) + os.sep, ".." + os.sep))


def tiers_of(kit_dir: pathlib.Path) -> list:
    """The tiers that carry this kit directory: a site archive -> tiers 0 and 2 (gpu_kit/README.md:
    `carry: [".whl/site"]`), the FlashInfer wheels alone -> tier 1 (`.whl/fi`)."""
    found = kit.find_kit(kit_dir)
    if found["site_archive"] is not None:
        return ["tier0", "tier2"]
    return ["tier1"] if found["flashinfer_wheels"] else []


def update_kit_record(kit_dir: pathlib.Path, command: str, record_path: pathlib.Path = KIT_RECORD,
                      before_archive: pathlib.Path | None = None, import_check: dict | None = None) -> dict:
    """Write this kit directory's entry into the kit record (gpu_kit/kit-record.json; the other
    kit's entry is kept): its files and their bytes, the archives' sha256s, the slimming, the import
    check, and the payload per tier = the repository's tracked files + the kit's files, with the
    headroom under 64 MiB (>= 10 required). before_archive: the site archive the kit replaces (the
    shared kit's), for `payload_before`. Returns the record."""
    record_path = pathlib.Path(record_path)
    rec = json.loads(record_path.read_text()) if record_path.exists() else {}
    kit_dir = pathlib.Path(kit_dir)
    tiers = tiers_of(kit_dir)
    if not tiers:
        raise kit.KitError(f"{kit_dir} holds neither a site archive nor the FlashInfer wheels")
    repo = repo_bytes()
    files = kit_files(kit_dir)
    kit_b = sum(files.values())
    total = repo["tracked"] + kit_b
    pay = {"repo_tracked_mib": round(repo["tracked"] / MIB, 2), "kit_mib": round(kit_b / MIB, 2),
           "total_mib": round(total / MIB, 2), "headroom_mib": round(CARRY_LIMIT_MIB - total / MIB, 2),
           "headroom_ok": CARRY_LIMIT_MIB - total / MIB >= HEADROOM_MIB}
    manifest = json.loads((kit_dir / kit.MANIFEST_FILE).read_text()) if (kit_dir / kit.MANIFEST_FILE).exists() else {}
    sums = kit.read_sums(kit_dir)
    entry = {"built": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
             "command": portable(command), "carry": portable(str(kit_dir.resolve())), "tiers": tiers,
             "files": {k: {"bytes": v, "sha256": sums.get(k)} for k, v in files.items()}, "payload": pay}
    if manifest.get("archive"):
        a = manifest["archive"]
        entry["site"] = {"files": a.get("files"), "unpacked_mib": round(a.get("unpacked_bytes", 0) / MIB, 1),
                         "restaged_from": manifest.get("restaged_from"),
                         "slimmed_mib": {k: round(v["bytes_saved"] / MIB, 1)
                                         for k, v in manifest.get("slimmed", {}).items()}}
    if manifest.get("aot"):
        entry["aot"] = {"uris": len(manifest["aot"].get("uris", [])),
                        "archive": manifest["aot"].get("archive", {}).get("name")}
    kind = "site" if "tier2" in tiers else "fi"
    prev = rec.get("kits", {}).get(kind, {})
    site_name = next((k for k in files if k.startswith("sglang-") and k.endswith(".tar.xz")), None)
    if import_check is None and prev.get("import_check") and site_name and \
            prev.get("files", {}).get(site_name, {}).get("sha256") == sums.get(site_name):
        import_check = prev["import_check"]  # same site archive (e.g. an --aot-only run): its check stands
    if import_check is not None:
        entry["import_check"] = import_check
    rec["limit_mib"], rec["headroom_required_mib"] = CARRY_LIMIT_MIB, HEADROOM_MIB
    rec["how"] = ("payload = the repository's tracked files (git ls-files, at build time) + every file in the "
                  "carried kit directory; untracked files of the building checkout are not counted")
    rec.setdefault("kits", {})[kind] = entry
    rec["payload_mib"] = {t: {"carry": e["carry"], **e["payload"]} for e in rec["kits"].values() for t in e["tiers"]}
    rec["payload_mib"] = dict(sorted(rec["payload_mib"].items()))
    if "tier2" in tiers:
        rec["tier2_kit_files_bytes"] = files
        rec["payload_after"] = {"what": f"tier 2: repository + {entry['carry']} ({', '.join(files)})", **pay}
        if before_archive is not None and pathlib.Path(before_archive).is_file():
            b = pathlib.Path(before_archive).stat().st_size
            rec["payload_before"] = {"what": f"repository + {pathlib.Path(before_archive).name} (the shared kit)",
                                     "repo_tracked_mib": pay["repo_tracked_mib"], "kit_mib": round(b / MIB, 2),
                                     "total_mib": round((repo["tracked"] + b) / MIB, 2),
                                     "headroom_mib": round(CARRY_LIMIT_MIB - (repo["tracked"] + b) / MIB, 2)}
    kit.write_json(record_path, rec)
    return rec


def find_flashinfer_wheel(*dirs) -> pathlib.Path | None:
    """The newest flashinfer_python-*.whl in the first of dirs that has one (None entries skipped)."""
    for d in dirs:
        if d:
            found = sorted(pathlib.Path(d).glob("flashinfer_python-*.whl"))
            if found:
                return found[-1]
    return None


def run_import_check(keep: pathlib.Path, wheel: pathlib.Path | None, aot_cache: pathlib.Path) -> dict:
    """import_check on the slimmed site (keep/site) and, when build() left it, the site before
    slimming (keep/site-full), side by side; the full records go to keep/import-check.json.
    Returns the summary: ok (no failure on the slimmed site and nothing lost against the full
    one), the failures, what was lost, and which transformers model folders were imported."""
    import concurrent.futures

    import import_check

    if wheel is None:
        raise SystemExit("--import-check needs flashinfer_python-*.whl (in --out, --find-links, --keep's downloads or "
                         "--compare): "
                         "its scratch install brings nvidia-ml-py and tvm-ffi for this interpreter")
    extra = flashinfer_scratch(pathlib.Path(aot_cache), wheel)[1:]
    sites = {"slimmed": keep / "site", "full": keep / "site-full"}
    sites = {k: v for k, v in sites.items() if v.is_dir()}
    with concurrent.futures.ThreadPoolExecutor(len(sites)) as ex:
        futs = {k: ex.submit(import_check.check, v, extra) for k, v in sites.items()}
        recs = {k: f.result() for k, f in futs.items()}
    kit.write_json(keep / "import-check.json", recs)
    slim_rec = recs["slimmed"]
    failures = import_check.failures(slim_rec)
    lost = import_check.compare(recs["full"], slim_rec) if "full" in recs else None
    return {"ok": not failures and not lost, "failures": failures,
            "full_site_failures": import_check.failures(recs["full"]) if "full" in recs else None,
            "lost_against_full": lost,
            "modules_ok": sum(v == "ok" for v in slim_rec.get("modules", {}).values()),
            "modules": len(slim_rec.get("modules", {})), "archs": slim_rec.get("archs"),
            "transformers_models_imported": slim_rec.get("transformers_models")}


def main(argv=None) -> int:
    """CLI (see the module doc)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(kit.DEFAULT_KIT_DIR))
    ap.add_argument("--packages", nargs="+", help="name-version pins (default: gpu_kit/site-contents.txt)")
    ap.add_argument("--flashinfer-only", action="store_true", help=f"just {' '.join(FLASHINFER_ONLY)}")
    ap.add_argument("--find-links", help="a local wheel directory instead of any index (offline)")
    ap.add_argument("--restage", help="start from this site archive (e.g. the shared kit's) instead of PyPI")
    ap.add_argument("--xz-preset", type=int, default=9)
    ap.add_argument("--keep", help="keep downloads and the staged site in this directory")
    ap.add_argument("--compare", help="a kit directory to diff the archive against (e.g. ../shared/gpu-kit)")
    ap.add_argument("--aot", action="store_true", help="also compile FlashInfer's modules (gpu_kit/aot.py) into "
                    f"{aot.AOT_ARCHIVE} and record them in gpu_kit/flashinfer-aot.json")
    ap.add_argument("--aot-only", action="store_true", help="only add the AOT archive to the kit in --out")
    ap.add_argument("--aot-status", action="store_true", help="compile nothing; record what the cache holds")
    ap.add_argument("--aot-cache", default=str(kit.REPO / "build" / "flashinfer-aot"),
                    help="where modules are compiled and kept (reused by later builds)")
    ap.add_argument("--jobs", type=int, default=1, help="ninja jobs for the AOT compile (MAX_JOBS)")
    ap.add_argument("--import-check", action="store_true",
                    help="faked-H100 import check of SGLang's serving path on the slimmed site and the site before "
                         "slimming (needs --keep); a failure or anything lost exits 1")
    ap.add_argument("--record", default=str(KIT_RECORD),
                    help="the kit record to update with this kit's files and payload ('' : none)")
    args = ap.parse_args(argv)
    out = pathlib.Path(args.out)
    shown = "python gpu_kit/build_kit.py " + " ".join(a for a in (argv if argv is not None else sys.argv[1:]))
    status = 0
    import_rec = None
    if not (args.aot_only or args.aot_status):
        if args.import_check and not args.keep:
            raise SystemExit("--import-check needs --keep DIR (the staged site)")
        specs = FLASHINFER_ONLY if args.flashinfer_only else args.packages
        pins = [parse_spec(s) for s in specs] if specs else read_contents(CONTENTS)
        manifest = build(pins, out, args.find_links, args.xz_preset, args.keep, shown, args.restage,
                         keep_full=args.import_check)
        a = manifest["archive"]
        if a:
            print(f"[kit] {len(pins)} packages -> {a['name']}: {a['bytes'] / 2**20:.1f} MiB ({a['files']} files, "
                  f"{a['unpacked_bytes'] / 2**20:.0f} MiB unpacked), sha256 {a['sha256']}")
        for p in manifest["packages"]:
            if p.get("wheel"):
                print(f"[kit] {p['wheel']}  {p['bytes'] / 2**20:.1f} MiB  sha256 {p['sha256']}")
        for pkg, s in manifest["slimmed"].items():
            print(f"[kit] slimmed {pkg}: -{s['bytes_saved'] / 2**20:.1f} MiB ({len(s['removed'])} removed, "
                  f"{len(s['stripped'])} stripped{', fat binary pruned' if s.get('fatbin_zeroed') else ''})")
        if args.compare and not a:
            print(json.dumps({"wheels_equal_to_theirs": _same_wheels(manifest, pathlib.Path(args.compare))}))
        if args.compare and a:
            theirs = kit.find_kit(pathlib.Path(args.compare))["site_archive"]
            if theirs is None:
                print(f"[kit] nothing to compare: no site archive in {args.compare}")
            else:
                diff = compare(out / a["name"], theirs)
                diff["wheels_equal_to_theirs"] = _same_wheels(manifest, pathlib.Path(args.compare))
                kit.write_json(out / "compare.json", diff)
                print(json.dumps({k: v for k, v in diff.items() if not k.endswith("_files")}, indent=1))
        if args.import_check:
            wheel = find_flashinfer_wheel(out, args.find_links, pathlib.Path(args.keep) / "wheels", args.compare)
            import_rec = run_import_check(pathlib.Path(args.keep), wheel, pathlib.Path(args.aot_cache))
            manifest["import_check"] = import_rec
            kit.write_json(out / kit.MANIFEST_FILE, manifest)
            failure_note = ("" if import_rec["ok"]
                            else ": " + str(import_rec["failures"] + (import_rec["lost_against_full"] or [])))
            print(f"[kit] import check ({import_rec['modules_ok']}/{import_rec['modules']} modules, archs "
                  f"{import_rec['archs']}): {'ok' if import_rec['ok'] else 'FAILED'}{failure_note}"
                  f"; transformers models imported {import_rec['transformers_models_imported']}; "
                  f"details in {pathlib.Path(args.keep) / 'import-check.json'}")
            status = 0 if import_rec["ok"] else 1
    if args.aot or args.aot_only or args.aot_status:
        wheel = find_flashinfer_wheel(out, args.find_links, args.keep and pathlib.Path(args.keep) / "wheels",
                                      args.compare)
        if wheel is None:
            raise SystemExit("no flashinfer_python-*.whl in --out, --find-links, --keep's downloads or --compare "
                             "for the AOT build")
        rec = add_aot(out, wheel, pathlib.Path(args.aot_cache), args.jobs, args.xz_preset, shown,
                      status_only=args.aot_status)
        for r in rec["modules"]:
            print(f"[aot] {r['uri']}: " + (f"{r['bytes'] / 2**20:.2f} MiB, {r.get('build_seconds')} s, "
                                           f"needs {r['needed']}" if r.get("bytes") else "not built yet"))
        if rec["archive"]:
            print(f"[aot] {rec['archive']['name']}: {rec['archive']['bytes'] / 2**20:.2f} MiB")
    pay = payload(out)
    mpath = out / kit.MANIFEST_FILE
    if mpath.exists():
        manifest = json.loads(mpath.read_text())
        manifest["payload"] = pay
        kit.write_json(mpath, manifest)
    print(f"[kit] payload with this repository: {pay['total_mib']} MiB of {pay['limit_mib']} "
          f"(repo {pay['repo_tracked_mib']} + {pay['repo_untracked_mib']} untracked, kit {pay['kit_mib']}); "
          f"headroom {pay['headroom_mib']} MiB{'' if pay['headroom_ok'] else f' < {HEADROOM_MIB} MiB: TOO BIG'}")
    if args.record and not args.aot_status and tiers_of(out):
        before = pathlib.Path(args.restage) if args.restage else (
            kit.find_kit(pathlib.Path(args.compare))["site_archive"] if args.compare else None)
        rec = update_kit_record(out, shown, pathlib.Path(args.record), before, import_rec)
        for t, p in rec["payload_mib"].items():
            print(f"[kit] {t} ({p['carry']}): repo {p['repo_tracked_mib']} + kit {p['kit_mib']} = "
                  f"{p['total_mib']} MiB, "
                  f"headroom {p['headroom_mib']} MiB{'' if p['headroom_ok'] else f' < {HEADROOM_MIB} MiB: TOO BIG'}")
        print(f"[kit] recorded in {portable(args.record)}")
    return status


if __name__ == "__main__":
    sys.exit(main())
