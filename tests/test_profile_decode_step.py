"""`bench/profile_decode_step.py` at a small size (CI runs the benchmark's code, the committed records its full size):
the real backend on SGLang's CPU pools, one level and two levels in one pass and in two, aten ops counted."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_profiles_one_level_and_both_two_level_passes(tmp_path):
    cmd = [sys.executable, str(REPO / "bench" / "profile_decode_step.py"), "--contexts", "4096", "--batches", "1",
           "--budget", "512", "--steps", "0", "--exact-rerank", "1", "2", "--rerank-passes", "one", "two",
           "--threads", "1", "--label", "ci", "--out", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads(next(tmp_path.glob("profile-decode-step-cpu-ci-*.json")).read_text())
    rows = {(r["backend"], r["exact_rerank"], r["rerank_pass"]): r for r in record["rows"]}
    assert set(rows) == {("dense", None, None), ("sas", 1, None), ("sas", 2, "one"), ("sas", 2, "two")}
    one_level = rows[("sas", 1, None)]["aten_ops_per_layer"]
    # a second level runs on top of the first: more ops a layer either way (and the sparse path ran at all)
    assert rows[("sas", 2, "one")]["aten_ops_per_layer"] > one_level > rows[("dense", None, None)]["aten_ops_per_layer"]
    assert rows[("sas", 2, "two")]["aten_ops_per_layer"] > one_level
    assert "X=2 (one pass)" in done.stdout and "X=2 (two pass)" in done.stdout
