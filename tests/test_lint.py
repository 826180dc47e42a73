"""The tree passes `ruff check` with the project's settings (pyproject.toml's [tool.ruff]: E, F, W, lines of
at most 120). ruff comes with the test extra; without it this test is skipped, saying so."""

from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]


def ruff_command() -> list[str] | None:
    """`python -m ruff` where the ruff package is importable, else a ruff binary beside this interpreter."""
    if importlib.util.find_spec("ruff") is not None:
        return [sys.executable, "-m", "ruff"]
    exe = pathlib.Path(sys.executable).with_name("ruff")
    return [str(exe)] if exe.is_file() else None


def test_ruff_check_finds_nothing():
    cmd = ruff_command()
    if cmd is None:
        pytest.skip("ruff is not installed in this environment "
                    "(it comes with the test extra: pip install -e '.[test]')")
    # --no-cache: nothing written into the tree; the settings are pyproject.toml's, found from the repository root
    r = subprocess.run([*cmd, "check", "--no-cache", "--output-format", "concise", "."],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"ruff check . (from {REPO}) found problems:\n{r.stdout}{r.stderr}"
