"""Where a result came from: the commit it was measured at, and paths named relative to the repository.

Results committed under bench/results/ name their inputs and outputs relative to the repository
(never a path of the machine that made them) and the commit of the code that made them.
"""

from __future__ import annotations

import os
import pathlib
import subprocess

from sas_backend.paths import source_checkout


def git_state(repo=None) -> dict:
    """`{"commit": full sha or "unknown", "dirty": [changed tracked files]}` of `repo` (default:
    this package's checkout). `$SAS_COMMIT`, when set, names the commit (a tree copied to another
    machine has no .git, or a stale one); else git does."""
    root = repo or source_checkout()

    def git(*args):
        if root is None:
            return ""
        try:
            return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    # An explicit $SAS_COMMIT wins: a tree copied to another machine may carry a stale .git (the first
    # GPU run's summary named the previous session's HEAD that way).
    commit = os.environ.get("SAS_COMMIT") or git("rev-parse", "HEAD") or "unknown"
    return {"commit": commit, "dirty": git("status", "--porcelain", "--untracked-files=no").splitlines()}


def repo_relative(path) -> str:
    """`path` relative to the repository when inside it, else just its file name."""
    p = pathlib.Path(path).resolve()
    root = source_checkout()
    return str(p.relative_to(root)) if root is not None and p.is_relative_to(root) else p.name


def portable_path(path: str) -> str:
    """A path as a record may keep it: `@names` and relative paths as given, an absolute path
    inside the repository relative to it, any other absolute path by its last component only
    (a path of this machine means nothing elsewhere)."""
    if path.startswith("@"):
        return path
    return repo_relative(path) if os.path.isabs(path) else os.path.normpath(path)


def portable_argv(argv) -> list:
    """`argv` with every absolute path made portable (see `portable_path`), `--flag=/abs` included."""
    out = []
    for a in argv:
        flag, eq, value = a.partition("=") if a.startswith("--") else ("", "", a)
        if eq and os.path.isabs(value):
            out.append(f"{flag}={portable_path(value)}")
        elif not eq and os.path.isabs(a):
            out.append(portable_path(a))
        else:
            out.append(a)
    return out
