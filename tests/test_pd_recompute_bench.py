"""bench/pd_recompute.py at a small size: the recompute pass and the dense step are timed for every context and
summary count asked, and the record names the machine and its command."""

from __future__ import annotations

import importlib.util
import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_small_run_writes_a_complete_record(tmp_path):
    spec = importlib.util.spec_from_file_location("pd_recompute", ROOT / "bench" / "pd_recompute.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "r.json"
    assert bench.main(["--gate", str(ROOT / "gate_checkpoints" / "qwen2.5-coder-0.5b-instruct-sas"), "--contexts",
                       "512", "1024", "--sub-blocks", "1", "4", "--repeats", "1", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert [(r["context"], r["sub_blocks"]) for r in record["rows"]] == [(512, 1), (512, 4), (1024, 1), (1024, 4)]
    for r in record["rows"]:
        assert r["recompute_s"] > 0 and r["dense_step_s"] > 0 and r["layers"] == 24 and r["pages"] == r["context"] // 64
        # Qwen2.5-0.5B: 2 kv heads of 64 dims, gate dim 128; fp32 summary rows (x sub-blocks) a page, bf16 K and V
        assert r["summary_transfer_bytes"] == 24 * r["pages"] * 2 * 128 * r["sub_blocks"] * 4
        assert r["kv_transfer_bytes"] == 2 * r["k_bytes"] == 2 * 24 * r["context"] * 2 * 64 * 2
    assert record["machine"]["cores"] and "pd_recompute.py" in record["command"]
    assert "cores" in out.with_suffix(".md").read_text()
