"""The GPU kit: what travels to an offline GPU host, and how it is unpacked and installed there.

Standard library only: this module runs on the GPU host before anything is installed, and in
the builder (`build_kit.py`) on a CPU machine.

Layout of the kit directory (`.whl/` in the repository root, git-ignored; the shared kit's layout):

    sglang-<ver>-h100-site.tar.xz   SGLang's minimal serving set, `pip install --target` tree, xz
    flashinfer_python-*.whl          FlashInfer alone (tier 1 needs no SGLang) ...
    apache_tvm_ffi-*.whl             ... and its one compiled dependency
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

REPO = pathlib.Path(__file__).resolve().parents[2]
DEFAULT_KIT_DIR = REPO / ".whl"
SITE_ARCHIVE_GLOB = "sglang-*-site.tar.xz"
FLASHINFER_WHEEL_GLOBS = ("flashinfer_python-*.whl", "apache_tvm_ffi-*.whl")
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
    """{"site_archive": Path | None, "flashinfer_wheels": [Path, ...]} found in kit_dir."""
    kit_dir = pathlib.Path(kit_dir)
    archives = sorted(kit_dir.glob(SITE_ARCHIVE_GLOB))
    wheels = [w for g in FLASHINFER_WHEEL_GLOBS for w in sorted(kit_dir.glob(g))]
    return {"site_archive": archives[-1] if archives else None, "flashinfer_wheels": wheels}


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
    (info / "INSTALLER").write_text("bench/gpu/kit.py\n")
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
        raise KitError(f"no {SITE_ARCHIVE_GLOB} in {kit_dir}: copy the kit there first (bench/gpu/README.md)")
    elif len(wheels) == len(FLASHINFER_WHEEL_GLOBS):
        record["checked"] = verify(kit_dir, [w.name for w in wheels])
        pip_target(wheels, site, python, host_tags=True)
        record["installed_wheels"] = [w.name for w in wheels]
    else:
        raise KitError(f"neither {SITE_ARCHIVE_GLOB} nor the FlashInfer wheels in {kit_dir}")
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


def write_json(path: pathlib.Path, obj) -> None:
    """JSON with a trailing newline, parents created."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2, default=str) + "\n")
