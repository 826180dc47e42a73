"""Build the GPU kit from PyPI: SGLang's minimal serving set as one xz archive, FlashInfer's wheels,
SHA256SUMS and a manifest. Runs on any x86-64 machine with network (wheels are fetched for the GPU
host's CPython 3.12, not this interpreter's).

    python bench/gpu/build_kit.py --out .whl                       # the whole kit (~0.75 GB download)
    python bench/gpu/build_kit.py --out /tmp/fi --packages flashinfer_python-0.6.12 apache_tvm_ffi-0.1.11
    python bench/gpu/build_kit.py --out .whl --compare ../shared/gpu-kit    # and diff against a kit

Steps: (1) `pip download --no-deps --only-binary=:all:` of every `name-version` in
bench/gpu/site-contents.txt (the shared kit's list) or `--packages`, for cp312 manylinux x86-64;
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

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import kit  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
CONTENTS = HERE / "site-contents.txt"
PYTHON_VERSION, PLATFORMS, target_args = kit.PYTHON_VERSION, kit.PLATFORMS, kit.target_args
FLASHINFER_ONLY = ["flashinfer_python-0.6.12", "apache_tvm_ffi-0.1.11"]
FIXED_MTIME = 1700000000  # archive members' mtime (reproducible archives)

# What the kit does not carry, by package: paths (fnmatch against site-relative POSIX paths) to
# delete, and shared objects to strip of debug info. sglang-kernel: Hopper (sm90) common ops only,
# so SGLang must be told `--attention-backend flashinfer` (it would pick FA3 on Hopper).
SLIM = {
    "sglang_kernel": {
        "remove": ["sgl_kernel/sm100", "sgl_kernel/sm100/*", "sgl_kernel/*/flash_ops*.so", "sgl_kernel/flash_ops*.so",
                   "sgl_kernel/*/flashmla_ops*.so", "sgl_kernel/flashmla_ops*.so"],
        "strip": [],
    },
    "xgrammar": {"remove": ["xgrammar/*.a", "xgrammar/*/*.a", "xgrammar/*/*/*.a"], "strip": ["xgrammar/*.so", "xgrammar/*/*.so"]},
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


def slim(stage: pathlib.Path, packages, rules=None) -> dict:
    """Apply the slimming rules of the packages present; returns {package: {"removed": [...],
    "stripped": [...], "bytes_saved": n}}. Stripping needs binutils' `strip` (skipped without it)."""
    rules = SLIM if rules is None else rules
    report = {}
    files = sorted(p for p in stage.rglob("*"))
    for pkg in packages:
        rule = rules.get(_norm(pkg))
        if not rule:
            continue
        removed, stripped, saved = [], [], 0
        for p in files:
            rel = p.relative_to(stage).as_posix()
            if not p.exists() or not _matches(rel, rule.get("remove", [])):
                continue
            size = sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) if p.is_dir() else p.stat().st_size
            shutil.rmtree(p) if p.is_dir() else p.unlink()
            removed.append(rel)
            saved += size
        strip = shutil.which("strip")
        for p in files:
            rel = p.relative_to(stage).as_posix()
            if strip and p.is_file() and _matches(rel, rule.get("strip", [])):
                before = p.stat().st_size
                subprocess.run([strip, "--strip-debug", str(p)], check=True)
                saved += before - p.stat().st_size
                stripped.append(rel)
        drop_record_lines(stage, removed)
        report[_norm(pkg)] = {"removed": removed, "stripped": stripped, "bytes_saved": saved}
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
    with lzma.open(tmp, "wb", preset=preset) as xz, tarfile.open(fileobj=xz, mode="w", format=tarfile.PAX_FORMAT) as tar:
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


def build(pins, out: pathlib.Path, find_links=None, preset=9, keep=None, command=None) -> dict:
    """Download, install, slim, pack; write SHA256SUMS and manifest.json into out. Returns the manifest."""
    out.mkdir(parents=True, exist_ok=True)
    work = pathlib.Path(keep) if keep else pathlib.Path(tempfile.mkdtemp(prefix="sas-kit-"))
    try:
        wheels = download(pins, work / "wheels", find_links)
        stage = work / "site"
        if stage.exists():
            shutil.rmtree(stage)
        install(list(wheels.values()), stage)
        portable = make_portable(stage)
        slimmed = slim(stage, [n for n, _ in pins])
        versions = dict(pins)
        sglang = next((v for n, v in pins if _norm(n) == "sglang"), None)
        name = f"sglang-{sglang}-h100-site.tar.xz" if sglang else "site.tar.xz"
        archive = out / name
        # FlashInfer alone travels as its two wheels (tier 1); anything else as the archive.
        wheels_only = {_norm(n) for n, _ in pins} <= {"flashinfer_python", "apache_tvm_ffi"}
        packed = {} if wheels_only else pack(stage, archive, preset)
        carried = []
        for n in ("flashinfer_python", "apache_tvm_ffi"):
            if n in wheels:
                shutil.copy(wheels[n], out / wheels[n].name)
                carried.append(wheels[n].name)
        manifest = {
            "built": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": command, "python": PYTHON_VERSION, "platforms": PLATFORMS,
            "packages": [{"name": n, "version": versions[n], "wheel": wheels[_norm(n)].name,
                          "sha256": kit.sha256_of(wheels[_norm(n)]), "bytes": wheels[_norm(n)].stat().st_size}
                         for n, _ in pins],
            "archive": None if wheels_only else {"name": name, "sha256": kit.sha256_of(archive),
                                                 "bytes": archive.stat().st_size, "xz_preset": preset, **packed},
            "flashinfer_wheels": carried,
            "slimmed": slimmed, "made_portable": portable,
        }
        sums = [] if wheels_only else [f"{manifest['archive']['sha256']}  {name}"]
        sums += [f"{p['sha256']}  {p['wheel']}" for p in manifest["packages"] if p["wheel"] in carried]
        (out / kit.SUMS_FILE).write_text("\n".join(sums) + "\n")
        kit.write_json(out / kit.MANIFEST_FILE, manifest)
        return manifest
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)


def main(argv=None) -> int:
    """CLI (see the module doc)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(kit.DEFAULT_KIT_DIR))
    ap.add_argument("--packages", nargs="+", help="name-version pins (default: bench/gpu/site-contents.txt)")
    ap.add_argument("--flashinfer-only", action="store_true", help=f"just {' '.join(FLASHINFER_ONLY)}")
    ap.add_argument("--find-links", help="a local wheel directory instead of any index (offline)")
    ap.add_argument("--xz-preset", type=int, default=9)
    ap.add_argument("--keep", help="keep downloads and the staged site in this directory")
    ap.add_argument("--compare", help="a kit directory to diff the archive against (e.g. ../shared/gpu-kit)")
    args = ap.parse_args(argv)
    specs = FLASHINFER_ONLY if args.flashinfer_only else args.packages
    pins = [parse_spec(s) for s in specs] if specs else read_contents(CONTENTS)
    shown = "python bench/gpu/build_kit.py " + " ".join(a for a in (argv if argv is not None else sys.argv[1:]))
    manifest = build(pins, pathlib.Path(args.out), args.find_links, args.xz_preset, args.keep, shown)
    a = manifest["archive"]
    if a:
        print(f"[kit] {len(pins)} packages -> {a['name']}: {a['bytes'] / 2**20:.1f} MiB ({a['files']} files, "
              f"{a['unpacked_bytes'] / 2**20:.0f} MiB unpacked), sha256 {a['sha256']}")
    for p in manifest["packages"]:
        print(f"[kit] {p['wheel']}  {p['bytes'] / 2**20:.1f} MiB  sha256 {p['sha256']}")
    for pkg, s in manifest["slimmed"].items():
        print(f"[kit] slimmed {pkg}: -{s['bytes_saved'] / 2**20:.1f} MiB ({len(s['removed'])} removed, "
              f"{len(s['stripped'])} stripped)")
    if args.compare and not a:
        print(json.dumps({"wheels_equal_to_theirs": _same_wheels(manifest, pathlib.Path(args.compare))}))
    if args.compare and a:
        theirs = kit.find_kit(pathlib.Path(args.compare))["site_archive"]
        if theirs is None:
            print(f"[kit] nothing to compare: no site archive in {args.compare}")
        else:
            diff = compare(pathlib.Path(args.out) / a["name"], theirs)
            diff["wheels_equal_to_theirs"] = _same_wheels(manifest, pathlib.Path(args.compare))
            kit.write_json(pathlib.Path(args.out) / "compare.json", diff)
            print(json.dumps({k: v for k, v in diff.items() if not k.endswith("_files")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
