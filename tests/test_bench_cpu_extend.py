"""bench/bench_cpu_extend.py at a CI size: both extends run on the same inputs, agree, and are recorded."""

from __future__ import annotations

import json
import pathlib

REPO = pathlib.Path(__file__).resolve().parent.parent


def test_bench_cpu_extend_small(tmp_path):
    import bench_cpu_extend

    assert bench_cpu_extend.main(["--contexts", "640", "--chunk", "256", "--hit", "64", "--heads", "6", "2", "32",
                                  "--repeats", "1", "--out", str(tmp_path)]) == 0
    (result,) = tmp_path.glob("cpu-extend-*.json")
    record = json.loads(result.read_text())
    cases = {r["case"]: r for r in record["rows"]}
    assert set(cases) == {"chunked prefill (256)", "radix hit (+64)"}
    assert cases["chunked prefill (256)"]["extends"] == 3  # 256 + 256 + 128: the last chunk partial
    for row in record["rows"]:
        assert row["max_abs_diff"] < 1e-5 and row["native_s"] > 0 and row["sas_s"] > 0
    assert record["method"] == "blocks" and record["geometry"] == {"h_q": 6, "h_kv": 2, "head_dim": 32, "layers": 24}
    assert "| 640 | radix hit (+64) |" in result.with_suffix(".md").read_text()
