"""bench/gate_generalization.sh (issue 24's study) end to end at a small size: a tiny model, a tiny
documentation corpus, 1024-token rows. Every step runs the real commands; the test checks what each leaves
behind, that a finished step is skipped on a rerun, and that the harness reports in- and out-of-domain text."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from tests.training.tiny_llama import ESSAYS_DIR, have_real_assets, save_tiny_model_dir

REPO = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = REPO / "bench" / "gate_generalization.sh"

pytestmark = pytest.mark.skipif(not have_real_assets(), reason="needs the prepared tokenizer and essays")


def _corpus(root: pathlib.Path) -> None:
    """docs/ and handbook/ as serve/prepare_corpus.py lays them out, made of essays (real English)."""
    essays = sorted(pathlib.Path(ESSAYS_DIR).glob("*.txt"))
    for i, path in enumerate(essays[:30]):
        domain = "handbook" if i % 10 == 9 else "docs"
        out = root / domain / "pkg" / path.name
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(path.read_text())


def test_study_runs_resumes_and_reports(tmp_path):
    model = save_tiny_model_dir(str(tmp_path / "tiny"))
    _corpus(tmp_path / "corpus")
    out, work = tmp_path / "out", tmp_path / "work"
    env = {**os.environ, "PYTHON": sys.executable, "MODEL": model, "INIT_GATE": "", "WORK": str(work),
           "SAS_CORPUS_DIR": str(tmp_path / "corpus"), "TOKENS": "3000", "SEQ": "1024", "TAIL": "256",
           "STEPS_TRAIN": "3", "WINDOWS": "1", "VAL_ROWS": "1", "RECALL_ROWS": "1", "BUDGETS": "256 512",
           "TRAIN_BUDGET": "512", "SHARDS": "1"}
    steps = ["corpus", "caches", "train-forced", "train-free", "harness"]  # needle: a real server, not a tiny model
    run = subprocess.run(["bash", str(SCRIPT), str(out), *steps], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=1200)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "all done" in run.stdout and "corpus: done" in run.stdout  # the given corpus, no download
    for cache in ("docs", "code", "essays", "docs-recall", "val-docs", "val-code"):
        manifest = json.loads((work / "cache" / cache / "manifest.json").read_text())
        assert (work / "cache" / cache / ".complete").exists() and manifest["rows"] >= 1, cache
    assert json.loads((work / "cache" / "docs-recall" / "manifest.json").read_text())["recall"]
    for name, forced in (("train-forced", 1), ("train-free", 0)):
        config = json.loads((work / name / "config.json").read_text())
        assert (config["training"]["sink_blocks"], config["training"]["local_blocks"]) == (forced, forced)
        assert len((out / f"{name}.jsonl").read_text().splitlines()) == 3
    timings = dict(line.split("\t") for line in (out / "timings.tsv").read_text().splitlines())
    assert {"cache-docs", "train-free", "harness-site-packages-ood"} <= set(timings)
    results = {p.stem: json.loads(p.read_text()) for p in out.glob("quality-*.json")}
    assert set(results) == {"quality-docs-heldout", "quality-code-heldout", "quality-handbook-ood",
                            "quality-site-packages-ood"}
    assert results["quality-handbook-ood"]["data"]["split"] == "all"
    assert ({"forced+s1l1", "forced+s0l0", "free+s0l0", "oracle", "random"}
            <= set(results["quality-docs-heldout"]["results"]))

    report = subprocess.run([sys.executable, str(REPO / "bench" / "quality_report.py"),
                             str(out / "quality-docs-heldout.json"), str(out / "quality-handbook-ood.json"),
                             "--gate", "free+s1l1"], capture_output=True, text=True)
    assert report.returncode == 0, report.stderr
    assert "(in-domain heldout)" in report.stdout and "(out-of-domain)" in report.stdout
    assert "without forced blocks (free+s0l0)" in report.stdout

    again = subprocess.run(["bash", str(SCRIPT), str(out), *steps], cwd=REPO, env=env, capture_output=True, text=True,
                           timeout=600)
    assert again.returncode == 0 and "cache docs: done" in again.stdout and "train train-free: done" in again.stdout
    assert "harness handbook-ood: done" in again.stdout
    steps_timed = [line.split("\t")[0] for line in (out / "timings.tsv").read_text().splitlines()]
    assert steps_timed.count("cache-docs") == 1 and steps_timed.count("train-free") == 1  # skipped: not timed

    # a smaller study: one trained gate and one text in the harness, read from the same working files; with
    # HARNESS_REUSE every selector the first study measured on these windows is taken over, not measured again
    smaller = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "out-free"), "harness"], cwd=REPO,
                             env={**env, "GATES": "free", "HARNESS": "handbook-ood", "HARNESS_REUSE": str(out)},
                             capture_output=True, text=True, timeout=600)
    assert smaller.returncode == 0, smaller.stdout[-3000:] + smaller.stderr[-3000:]
    assert [p.name for p in (tmp_path / "out-free").glob("quality-*.json")] == ["quality-handbook-ood.json"]
    res = json.loads((tmp_path / "out-free" / "quality-handbook-ood.json").read_text())
    rows = set(res["results"])
    assert {"free+s1l1", "free+s0l0", "oracle"} <= rows and not any(r.startswith("forced") for r in rows)
    assert set(res["reused"]["measurements"]) == rows  # the same gate and baselines on the same windows
    first = json.loads((out / "quality-handbook-ood.json").read_text())
    assert res["dense"] == first["dense"] and all(res["results"][r] == first["results"][r] for r in rows)
    # a variant trained on the first study's caches (CACHE) with more trainer arguments (TRAIN_ARGS), under its
    # own step name in another WORK: nothing is cached again, the checkpoint records the arguments
    variant = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "out-cov"), "train-free-cov"], cwd=REPO,
                             env={**env, "WORK": str(tmp_path / "work-cov"), "CACHE": str(work / "cache"),
                                  "TRAIN_ARGS": "--coverage-weight 0.5 --coverage-budgets 256"},
                             capture_output=True, text=True, timeout=600)
    assert variant.returncode == 0, variant.stdout[-3000:] + variant.stderr[-3000:]
    training = json.loads((tmp_path / "work-cov" / "train-free-cov" / "config.json").read_text())["training"]
    assert (training["sink_blocks"], training["local_blocks"]) == (0, 0)
    assert training["coverage"] == {"weight": 0.5, "budgets": [256], "temperature": 0.05}
    assert not (tmp_path / "work-cov" / "cache").exists() and (tmp_path / "out-cov" / "train-free-cov.jsonl").exists()
    wrong = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "out-wrong"), "harness"], cwd=REPO,
                           env={**env, "HARNESS": "essays-ood"}, capture_output=True, text=True, timeout=60)
    assert wrong.returncode != 0 and "unknown harness text essays-ood" in wrong.stderr
