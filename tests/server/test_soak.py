"""The soak (`python -m sas_backend.soak`) at CI size: the same code as the committed 1000-request run
(bench/results/2026-11-26-soak), with 20 requests over 30 s, a 1280-token context limit, a 2560-token KV pool
(room for two requests at the limit: the queue fills) and a 512-token budget (a decode step with more than 8
complete blocks before its own, from 577 tokens, selects). The workload's seed is chosen so that 20 requests
hold every kind the test asserts on (test_ci_workload_has_every_kind checks it without a server, so a workload
change fails in seconds, not after the soak): seed 0 at 40 requests over a minute (until 2026-12-02) drew 1
over-limit request, 3 client aborts, 3 shared-prefix prompts; at 20 requests seed 0 drew no over-limit request
(tried on 2026-12-02) and seed 60 draws 1, 2 aborts and 4 shared-prefix prompts, 8.5K prompt tokens in 30 s
(seed 0 at 40: 9.0K in 60 s). tests/test_soak_parts.py checks the workload's own rules."""

from __future__ import annotations

import json

import collections

from sas_backend.soak.__main__ import build_parser, main, soak_workload, text_ids
from sas_backend.testing.server import ON_GPU

POOL = 2560  # KV tokens
CI_ARGS = ["--requests", "20", "--duration-min", "0.5", "--seed", "60", "--context-len", "1280",
           "--max-total-tokens", str(POOL), "--max-new-tokens", "64", "--budget", "512"]


def test_ci_workload_has_every_kind(model_dir):
    """The CI workload holds what test_soak_small asserts the server handled: an over-limit prompt, client
    aborts, shared prefixes, and prompts past the budget (decoded sparsely)."""
    args = build_parser().parse_args([*CI_ARGS, "--model", str(model_dir), "--out", "unused"])
    _, workload = soak_workload(args, text_ids(args.model))
    kinds = collections.Counter(r.kind for r in workload)
    assert kinds["over_limit"] >= 1 and kinds["stream_abort"] >= 1, kinds
    assert sum(r.shared_prefix >= 0 for r in workload) >= 1
    # sparse from the first decode step: more than K = 8 complete blocks before the prompt's last block
    assert sum(576 < len(r.prompt) <= 1280 for r in workload) >= 3


def test_soak_small(tmp_path):
    out = tmp_path / "soak"
    rc = main([*CI_ARGS, "--out", str(out)])
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
    # Sparse steps really ran: every step of a batch holding one of the >= 3 prompts over 576 tokens selects (on
    # CPU a batch of short requests only runs the dense decode, which a covering budget equals).
    steps = report["pool_after_flush"]["decode_steps"]
    assert steps["sparse"] >= 10, steps
    flags = report["server_args"]  # what the server ran with, the harness's own flags included
    assert flags[flags.index("--max-total-tokens") + 1] == str(POOL) and "--sleep-on-idle" in flags
    assert "--dtype" in flags or ON_GPU
