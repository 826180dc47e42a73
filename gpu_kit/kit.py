"""The GPU kit: what travels to an offline GPU host, and how it is unpacked and installed there.

Standard library only: this module runs on the GPU host before anything is installed, and in
the builder (`build_kit.py`) on a CPU machine.

Layout of the kit directory (`.whl/` in the repository root, git-ignored; the shared kit's layout):

    sglang-<ver>-h100-site.tar.xz   SGLang's minimal serving set, `pip install --target` tree, xz
    flashinfer_python-*.whl          FlashInfer alone (tiers 0 and 1 need no SGLang) ...
    apache_tvm_ffi-*.whl             ... and its one compiled dependency
    flashinfer-aot-*-sm90a.tar.xz    FlashInfer's modules pre-built for sm90a, site-relative
                                     (flashinfer/data/aot/<uri>/<uri>.so): extracted over the site
    SHA256SUMS                       `sha256  name` lines, checked before use when present
    manifest.json                    written by build_kit.py: packages, versions, wheel sha256s

On the GPU host, `prepare_site` does what the shared kit's README says by hand: extract the
archive (or install the FlashInfer wheels) into a `--target` directory, then install this
repository there with `pip install --no-index --no-deps --no-build-isolation --no-compile --target`.
`site_env` is the environment every later command runs in.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import subprocess
import sys
import tarfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_KIT_DIR = REPO / ".whl"
SITE_ARCHIVE_GLOB = "sglang-*-site.tar.xz"
FLASHINFER_WHEEL_GLOBS = ("flashinfer_python-*.whl", "apache_tvm_ffi-*.whl")
AOT_ARCHIVE_GLOB = "flashinfer-aot-*.tar.xz"  # pre-built FlashInfer modules (gpu_kit/aot.py)
SUMS_FILE = "SHA256SUMS"
MANIFEST_FILE = "manifest.json"
# FlashInfer JIT-compiles its kernels with the host's nvcc on first use: Hopper only, all cores,
# never try to download prebuilt cubins (the host is offline).
FLASHINFER_ENV = {"FLASHINFER_CUDA_ARCH_LIST": "9.0a", "MAX_JOBS": "16", "FLASHINFER_NO_DOWNLOAD": "1"}


# The GPU host's interpreter and the platforms its wheels may carry, most compatible first (so pip
# picks the same builds as the shared kit: manylinux2014 where offered).
PYTHON_VERSION = "3.12"
PLATFORMS = ["manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_24_x86_64", "manylinux_2_27_x86_64",
             "manylinux_2_28_x86_64", "manylinux_2_31_x86_64", "manylinux_2_34_x86_64", "linux_x86_64"]


def target_args(python_version: str = PYTHON_VERSION) -> list:
    """pip options that select wheels for the GPU host instead of the running interpreter."""
    nodot = python_version.replace(".", "")
    args = ["--only-binary=:all:", "--python-version", python_version, "--implementation", "cp",
            "--abi", f"cp{nodot}", "--abi", "abi3", "--abi", "none"]
    for p in PLATFORMS:
        args += ["--platform", p]
    return args


class KitError(RuntimeError):
    """The kit is missing, incomplete or corrupt."""


def sha256_of(path: os.PathLike) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks. (Stdlib twin of sas_backend's sha256_file:
    this module must run before the package is installed.)"""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def read_sums(kit_dir: pathlib.Path) -> dict:
    """{file name: sha256} from `kit_dir/SHA256SUMS` (empty when there is none)."""
    path = pathlib.Path(kit_dir) / SUMS_FILE
    if not path.exists():
        return {}
    sums = {}
    for line in path.read_text().splitlines():
        if line.strip():
            digest, name = line.split(maxsplit=1)
            sums[name.strip().lstrip("*")] = digest
    return sums


def verify(kit_dir: pathlib.Path, names) -> dict:
    """Check each named file against SHA256SUMS (files it does not list are reported as such).

    Returns {name: "ok" | "unlisted"}; raises KitError on a mismatch or a missing file."""
    sums = read_sums(kit_dir)
    result = {}
    for name in names:
        path = pathlib.Path(kit_dir) / name
        if not path.is_file():
            raise KitError(f"{path} is missing")
        if name not in sums:
            result[name] = "unlisted"
        elif sha256_of(path) != sums[name]:
            raise KitError(f"{name}: sha256 differs from {SUMS_FILE}; the copy is corrupt")
        else:
            result[name] = "ok"
    return result


def find_kit(kit_dir: pathlib.Path) -> dict:
    """{"site_archive": Path | None, "flashinfer_wheels": [Path, ...], "aot_archive": Path | None}
    found in kit_dir."""
    kit_dir = pathlib.Path(kit_dir)
    archives = sorted(kit_dir.glob(SITE_ARCHIVE_GLOB))
    wheels = [w for g in FLASHINFER_WHEEL_GLOBS for w in sorted(kit_dir.glob(g))]
    aot = sorted(kit_dir.glob(AOT_ARCHIVE_GLOB))
    return {"site_archive": archives[-1] if archives else None, "flashinfer_wheels": wheels,
            "aot_archive": aot[-1] if aot else None}


def unpack(archive: pathlib.Path, site: pathlib.Path) -> int:
    """Extract a site archive into `site` (created); returns the number of members."""
    site = pathlib.Path(site)
    site.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive) as tar:
        members = tar.getmembers()
        kwargs = {"filter": "fully_trusted"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(site, **kwargs)
    return len(members)


def pip_target(args, site: pathlib.Path, python: str = sys.executable, host_tags: bool = False) -> None:
    """`python -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target site ARGS`:
    offline, nothing resolved, nothing byte-compiled. host_tags: accept the GPU host's wheels
    (CPython 3.12 manylinux) whatever this interpreter is (only for wheels, not a source tree)."""
    cmd = [python, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-index", "--no-deps",
           "--no-build-isolation", "--no-compile", "--upgrade", *(target_args() if host_tags else []),
           "--target", str(site), *map(str, args)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise KitError(f"pip failed ({' '.join(cmd)}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def install_self(site: pathlib.Path, python: str = sys.executable) -> str:
    """Install this repository (sas-backend) into `site` without the network or its dependencies;
    returns how: "pip", or "copied (...)" when pip could not build it (e.g. a setuptools older
    than pyproject.toml needs, with no index to fetch a newer one), see `install_self_by_copy`.

    The build runs from a copy, so no build/ or egg-info is left in the checkout."""
    import shutil
    import tempfile

    with tempfile.TemporaryDirectory(prefix="sas-src-") as tmp:
        src = pathlib.Path(tmp) / "src"
        shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(
            ".git", ".venv*", ".whl", "models", "build", "*.egg-info", "__pycache__", "out", "results"))
        try:
            pip_target([src], site, python)
            return "pip"
        except KitError as e:
            install_self_by_copy(site)
            return f"copied (pip failed: {str(e).strip().splitlines()[-1][:200]})"


def install_self_by_copy(site: pathlib.Path) -> None:
    """The fallback install: the package directory copied into `site` with a dist-info holding
    METADATA and entry_points.txt from pyproject.toml, so `importlib.metadata` (and so SGLang's
    plugin discovery, group `sglang.srt.plugins`) finds it as if pip had installed it."""
    import shutil
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    name, version = project["name"], project["version"]
    shutil.copytree(REPO / "sas_backend", pathlib.Path(site) / "sas_backend", dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("__pycache__"))
    info = pathlib.Path(site) / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    groups = project.get("entry-points", {})
    (info / "entry_points.txt").write_text("".join(
        f"[{g}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()) + "\n" for g, eps in groups.items()))
    (info / "INSTALLER").write_text("gpu_kit/kit.py\n")
    (info / "RECORD").write_text("")


def prepare_site(kit_dir: pathlib.Path, site: pathlib.Path, need_sglang: bool, python: str = sys.executable) -> dict:
    """Make `site` hold what a tier needs, then this package; returns a record of what was done.

    need_sglang: tier 2 needs the site archive. Tier 1 takes the archive when present (it holds
    FlashInfer too), else the FlashInfer wheels."""
    t0 = time.time()
    found = find_kit(kit_dir)
    archive, wheels = found["site_archive"], found["flashinfer_wheels"]
    record = {"kit_dir": kit_dir.name, "site": str(site)}
    if archive is not None:
        record["checked"] = verify(kit_dir, [archive.name])
        record["unpacked"] = {"archive": archive.name, "members": unpack(archive, site)}
    elif need_sglang:
        raise KitError(f"no {SITE_ARCHIVE_GLOB} in {kit_dir}: copy the kit there first (gpu_kit/README.md)")
    elif len(wheels) == len(FLASHINFER_WHEEL_GLOBS):
        record["checked"] = verify(kit_dir, [w.name for w in wheels])
        pip_target(wheels, site, python, host_tags=True)
        record["installed_wheels"] = [w.name for w in wheels]
    else:
        raise KitError(f"neither {SITE_ARCHIVE_GLOB} nor the FlashInfer wheels in {kit_dir}")
    if found["aot_archive"] is not None:  # FlashInfer then loads these instead of compiling
        record["checked"].update(verify(kit_dir, [found["aot_archive"].name]))
        record["aot"] = {"archive": found["aot_archive"].name, "members": unpack(found["aot_archive"], site)}
    else:
        record["aot"] = None
    record["installed_self"] = install_self(site, python)
    record["seconds"] = round(time.time() - t0, 1)
    return record


def site_env(site: pathlib.Path, base=None) -> dict:
    """The environment for commands that use the kit: site first on PYTHONPATH, then the repo
    (tests import `tests.*`), FlashInfer's JIT settings, unbuffered output."""
    env = dict(os.environ if base is None else base)
    paths = [str(site), str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    for k, v in FLASHINFER_ENV.items():
        env.setdefault(k, v)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def site_python_tag(site: pathlib.Path) -> str | None:
    """The CPython version ('312') the site's compiled packages were built for, from their
    dist-info WHEEL tags (`cp312-cp312-...`, `cp312-abi3-...`: abi3 still needs >= 3.12), else
    from extension file names (`*.cpython-312-*.so`); None for a pure-Python site."""
    import collections
    import re

    tags = collections.Counter()
    for wheel in pathlib.Path(site).glob("*.dist-info/WHEEL"):
        for m in re.finditer(r"^Tag: cp(\d+)-(?:cp\d+|abi3)-", wheel.read_text(errors="replace"), re.M):
            tags[m.group(1)] += 1
    if not tags:
        for p in pathlib.Path(site).rglob("*.cpython-*-x86_64-linux-gnu.so"):
            tags[re.search(r"\.cpython-(\d+)-", p.name).group(1)] += 1
    return tags.most_common(1)[0][0] if tags else None


def installed_versions(site: pathlib.Path, names) -> dict:
    """{distribution: version or None} of the dist-info directories in `site` (no import needed,
    so it works on any interpreter, e.g. to inspect a kit built for another Python)."""
    site = pathlib.Path(site)
    found = {}
    for d in site.glob("*.dist-info"):
        name, _, rest = d.name[: -len(".dist-info")].partition("-")
        found[name.lower().replace("-", "_")] = rest
    return {n: found.get(n.lower().replace("-", "_")) for n in names}


# ------------------------------------------------------------------ CUDA toolkit for JIT fallback
def _is_toolkit(d) -> bool:
    d = pathlib.Path(d)
    return (d / "bin" / "nvcc").is_file() and (d / "include" / "cuda_runtime.h").is_file()


def find_cuda_home(env=None) -> dict:
    """The real CUDA toolkit directory (bin/nvcc and include/cuda_runtime.h both there), not the
    folder of a `nvcc` wrapper script: FlashInfer derives CUDA_HOME from `which nvcc` when it is
    unset, and a wrapper in /usr/local/bin then yields /usr/local (no headers, no libraries).

    Order: $CUDA_HOME / $CUDA_PATH; `which nvcc` resolved through symlinks; the path a wrapper
    script execs (`exec /usr/local/cuda-13.0/bin/nvcc "$@"`); /usr/local/cuda, /usr/local/cuda-*
    (newest first), /opt/cuda. Returns {"cuda_home", "nvcc", "how"} (None values when none)."""
    import re
    import shutil

    env = os.environ if env is None else env
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if env.get(var) and _is_toolkit(env[var]):
            return {"cuda_home": str(pathlib.Path(env[var])), "nvcc": str(pathlib.Path(env[var]) / "bin" / "nvcc"),
                    "how": f"${var}"}
    which = shutil.which("nvcc", path=env.get("PATH"))
    if which:
        real = pathlib.Path(which).resolve()
        if _is_toolkit(real.parent.parent):
            return {"cuda_home": str(real.parent.parent), "nvcc": str(real), "how": f"which nvcc -> {real}"}
        try:
            head = real.read_bytes()[:4096]
        except OSError:
            head = b""
        if not head.startswith(b"\x7fELF"):  # a wrapper script: follow the path it runs
            for m in re.finditer(rb"(/[^\s\"'$;|&]+)/bin/nvcc", head):
                cand = pathlib.Path(m.group(1).decode(errors="replace"))
                if _is_toolkit(cand):
                    return {"cuda_home": str(cand), "nvcc": str(cand / "bin" / "nvcc"),
                            "how": f"wrapper {which} runs {cand}/bin/nvcc"}
    import glob

    for cand in ["/usr/local/cuda", *sorted(glob.glob("/usr/local/cuda-*"), reverse=True), "/opt/cuda"]:
        if _is_toolkit(cand):
            return {"cuda_home": cand, "nvcc": str(pathlib.Path(cand) / "bin" / "nvcc"), "how": "well-known path"}
    return {"cuda_home": None, "nvcc": which, "how": "no CUDA toolkit found"}


def _ldconfig_paths(name: str) -> list:
    """Paths `ldconfig -p` lists for a library soname (empty without ldconfig)."""
    try:
        out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    found = []
    for line in out.splitlines():
        head, _, path = line.partition("=>")
        if head.strip().startswith(name + " ") and "x86-64" in head and path.strip():
            found.append(path.strip())
    return found


DRIVER_DIRS = ["/usr/local/nvidia/lib64", "/usr/local/nvidia/lib", "/usr/lib/x86_64-linux-gnu", "/usr/lib64",
               "/lib/x86_64-linux-gnu", "/usr/lib/wsl/lib"]


def find_library(soname: str, extra_dirs=()) -> str | None:
    """A path to `soname` (e.g. libcuda.so.1): the given directories, ldconfig's cache, the
    usual driver directories, $LD_LIBRARY_PATH."""
    dirs = list(extra_dirs) + [p for p in os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p]
    for d in dirs:
        if (pathlib.Path(d) / soname).exists():
            return str(pathlib.Path(d) / soname)
    for p in _ldconfig_paths(soname):
        if pathlib.Path(p).exists():
            return p
    for d in DRIVER_DIRS:
        if (pathlib.Path(d) / soname).exists():
            return str(pathlib.Path(d) / soname)
    return None


def link_shim(cuda_home, shim_dir: pathlib.Path) -> dict:
    """Make FlashInfer's JIT link line (`-L$CUDA_HOME/lib64 -L$CUDA_HOME/lib64/stubs -lcudart -lcuda`)
    resolve where the toolkit has no `lib64/stubs/libcuda.so` (or no unversioned `libcudart.so`):
    `shim_dir` gets `libcuda.so` -> the driver's libcuda.so.1 and, if needed, `libcudart.so` ->
    the toolkit's libcudart.so.13. Returns {"dir": shim_dir or None, "libcuda": ..., "libcudart": ...,
    "env": {FLASHINFER_EXTRA_LDFLAGS, LIBRARY_PATH additions}} (empty env when nothing was needed)."""
    rec = {"dir": None, "libcuda": None, "libcudart": None, "env": {}}
    home = pathlib.Path(cuda_home) if cuda_home else None
    lib64 = [home / "lib64", home / "lib64" / "stubs", home / "lib"] if home else []
    links = {}
    have_cuda = next((str(d / "libcuda.so") for d in lib64 if (d / "libcuda.so").exists()), None)
    if have_cuda:
        rec["libcuda"] = have_cuda
    else:
        target = find_library("libcuda.so.1")
        rec["libcuda"] = target
        if target:
            links["libcuda.so"] = target
    have_rt = next((str(d / "libcudart.so") for d in lib64 if (d / "libcudart.so").exists()), None)
    if have_rt:
        rec["libcudart"] = have_rt
    else:
        target = find_library("libcudart.so.13", [str(d) for d in lib64])
        rec["libcudart"] = target
        if target:
            links["libcudart.so"] = target
    if links:
        shim_dir = pathlib.Path(shim_dir)
        shim_dir.mkdir(parents=True, exist_ok=True)
        for name, target in links.items():
            link = shim_dir / name
            if link.is_symlink() or link.exists():
                link.unlink()
            link.symlink_to(target)
        rec["dir"] = str(shim_dir)
        rec["env"] = {"FLASHINFER_EXTRA_LDFLAGS": f"-L{shim_dir}", "LIBRARY_PATH": str(shim_dir)}
    return rec


def jit_env(base: dict, shim_dir: pathlib.Path) -> tuple:
    """(environment, record) for a GPU command whose FlashInfer may JIT-compile a module that the
    kit did not pre-build: CUDA_HOME = the real toolkit (`find_cuda_home`), its bin first on PATH,
    the link shim (`link_shim`) on FLASHINFER_EXTRA_LDFLAGS and LIBRARY_PATH, and
    SGLANG_FLASHINFER_USE_PAGED=1 (SGLang's paged fa2 prefill, the module the kit carries, instead of
    its ragged `backend="auto"` wrapper, which is FA3 on Hopper: another, slower, compile)."""
    env = dict(base)
    found = find_cuda_home(env)
    rec = {"cuda": found}
    if found["cuda_home"]:
        env["CUDA_HOME"] = found["cuda_home"]
        env["PATH"] = os.pathsep.join([str(pathlib.Path(found["cuda_home"]) / "bin"), env.get("PATH", "")])
        shim = link_shim(found["cuda_home"], shim_dir)
        rec["link"] = shim
        for k, v in shim["env"].items():
            env[k] = f"{v} {env[k]}" if k == "FLASHINFER_EXTRA_LDFLAGS" and env.get(k) else \
                os.pathsep.join([v, env[k]]) if env.get(k) else v
    env["SGLANG_FLASHINFER_USE_PAGED"] = "1"
    return env, rec


def write_json(path: pathlib.Path, obj) -> None:
    """JSON with a trailing newline, parents created."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2, default=str) + "\n")
