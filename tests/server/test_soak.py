"""The soak (`python -m sas_backend.soak`) at CI size: the same code as the committed 1000-request run
(bench/results/2026-11-26-soak), with 40 requests over one minute, a 1280-token context limit, a 2560-token
KV pool (room for two requests at the limit: the queue fills) and a 512-token budget (prompts past 8 blocks
decode sparsely). Measured on 2026-11-27: 1 over-limit request rejected, 3 client aborts, 3 shared-prefix
prompts, 2 retractions, a queue of 5 (20 requests over 30 s, tried on 2026-12-02, had no rejected request;
tests/test_soak_parts.py checks the workload's own rules)."""

from __future__ import annotations

import json

from sas_backend.testing.server import ON_GPU
from sas_backend.soak.__main__ import main

POOL = 2560  # KV tokens


def test_soak_small(tmp_path):
    out = tmp_path / "soak"
    rc = main(["--requests", "40", "--duration-min", "1", "--context-len", "1280", "--max-total-tokens", str(POOL),
               "--max-new-tokens", "64", "--budget", "512", "--out", str(out)])
    report = json.loads((out / "soak.json").read_text())
    assert rc == 0, report["failures"]
    results = report["summary"]["results"]
    assert results.get("unexpected", 0) == 0
    assert results.get("client_abort", 0) >= 1 and results.get("rejected", 0) >= 1, results
    assert report["summary"]["shared_prefix_requests"] >= 1
    assert report["log"]["max_queue"] >= 1  # the pool was small enough to make requests wait
    assert report["probes"]["tokens_equal"]
    pages = report["pool_after_flush"]["kv_pages"]
    assert pages["free"] == pages["total"] == POOL // 64
    assert report["pool_idle_after"]["summary_rows"]["held"] == 0
    flags = report["server_args"]  # what the server ran with, the harness's own flags included
    assert flags[flags.index("--max-total-tokens") + 1] == str(POOL) and "--sleep-on-idle" in flags
    assert "--dtype" in flags or ON_GPU
