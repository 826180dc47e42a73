"""The soak (`python -m sas_backend.soak`) at CI size: the same code as the committed 1000-request run
(bench/results/2026-11-26-soak), with 50 requests over one minute and a 4096-token KV pool."""

from __future__ import annotations

import json

from sas_backend.soak.__main__ import main


def test_soak_small(tmp_path):
    out = tmp_path / "soak"
    rc = main(["--requests", "50", "--duration-min", "1", "--context-len", "2048", "--max-total-tokens", "4096",
               "--max-new-tokens", "128", "--out", str(out)])
    report = json.loads((out / "soak.json").read_text())
    assert rc == 0, report["failures"]
    results = report["summary"]["results"]
    assert results.get("unexpected", 0) == 0
    assert results.get("client_abort", 0) >= 1 and results.get("rejected", 0) >= 1, results
    assert report["summary"]["shared_prefix_requests"] >= 1
    assert report["log"]["max_queue"] >= 1  # the pool was small enough to make requests wait
    assert report["probes"]["tokens_equal"]
    pages = report["pool_after_flush"]["kv_pages"]
    assert pages["free"] == pages["total"] == 4096 // 64
    assert report["pool_idle_after"]["summary_rows"]["held"] == 0
