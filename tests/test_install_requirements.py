"""serve/requirements_of.py: the requirement lists serve/install.sh's CPU recipe hands to pip. Metadata lines
only; no install."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import pathlib
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "serve" / "requirements_of.py"
_spec = importlib.util.spec_from_file_location("requirements_of", SCRIPT)
requirements_of = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(requirements_of)
extra_requirements = requirements_of.extra_requirements
sglang_cpu_requirements = requirements_of.sglang_cpu_requirements


def test_extra_keeps_its_own_extras_and_drops_the_marker():
    """`lm-eval[api,ruler]` stays whole (the bug of 2026-12-02: it installed as bare lm-eval, without tenacity,
    so every local-completions run died); only the asked extras' lines come back."""
    lines = ['lm-eval[api,ruler]==0.4.13; extra == "eval"', 'pytest<9.2; extra == "test"',
             "safetensors>=0.4", 'transformers>=5; extra == "train"']
    assert extra_requirements(lines, {"eval", "test"}) == ["lm-eval[api,ruler]==0.4.13", "pytest<9.2"]
    assert extra_requirements(lines, set()) == []


def test_sglang_list_leaves_out_cuda_only_extras_and_foreign_markers():
    lines = ["aiohttp", "flashinfer_python[cu13]==0.6.18", "nvidia-cutlass-dsl[cu13]==4.6.2", "torch==2.13.0",
             'uvloop; sys_platform == "never"', 'pytest; extra == "test"', "orjson>=3"]
    assert sglang_cpu_requirements(lines) == ["aiohttp", "orjson>=3"]


def test_our_eval_extra_names_lm_eval_with_its_extras():
    """The installed sas-backend's own metadata, as install.sh reads it."""
    out = subprocess.run([sys.executable, str(SCRIPT), "sas-backend", "--extras", "eval"],
                         capture_output=True, text=True, check=True).stdout.split()
    pinned = [line for line in importlib.metadata.requires("sas-backend") if line.startswith("lm-eval")]
    assert pinned and all("[api,ruler]" in line for line in pinned), pinned
    assert [r for r in out if r.startswith("lm-eval")] == [pinned[0].split(";")[0].strip()], out
