"""Re-encode result plots as palette PNGs (64 colours), in place, where that is smaller.

Every committed byte travels in each GPU device call (64 MiB with the kit: gpu_kit/README.md), and the
line plots under bench/results/ lose nothing visible at 64 colours (3.6 MiB -> 0.9 MiB on 2026-11-27).

    python bench/compact_png.py bench/results/<study>/*.png
"""

from __future__ import annotations

import argparse
import io
import pathlib

from PIL import Image


def compact(path: pathlib.Path, colours: int = 64) -> tuple:
    """Rewrite `path` as a `colours`-colour palette PNG if that is smaller; returns (bytes before, after)."""
    before = path.stat().st_size
    with Image.open(path) as im:
        if im.mode == "P":
            return before, before
        small = im.convert("RGB").quantize(colors=colours, method=Image.Quantize.MEDIANCUT)
    buf = io.BytesIO()
    small.save(buf, format="PNG", optimize=True)
    if buf.tell() >= before:
        return before, before
    path.write_bytes(buf.getvalue())
    return before, buf.tell()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("pngs", nargs="+", type=pathlib.Path)
    ap.add_argument("--colours", type=int, default=64)
    args = ap.parse_args(argv)
    total = [0, 0]
    for p in args.pngs:
        a, b = compact(p, args.colours)
        total[0] += a
        total[1] += b
        print(f"{p}: {a} -> {b} bytes")
    print(f"total: {total[0] / 2**20:.2f} -> {total[1] / 2**20:.2f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
