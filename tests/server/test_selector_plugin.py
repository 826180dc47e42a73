"""A selector registered from outside the package is served like a built-in (issue 62 item 1): the server
imports `--sas-selector-module tests.toy_selector` in each of its processes, and `--sas-selector toy-recency`
(tests/toy_selector.py; no other module names it) selects by its own per-page state. With one forced sink
block its rule is sink-local's, so every step's selection is stated here and its tokens are checked against
the independent oracle (tests/server/oracle.py) under the sink-local rule."""

from __future__ import annotations

import json
import pathlib

import requests

from sas_backend.testing.server import ON_GPU, Server
from tests.server.compare import generate
from tests.server.oracle import Rule, oracle_check

REPO = pathlib.Path(__file__).resolve().parents[2]
BLOCK, BUDGET = 64, 256  # K = 4: block 0 forced, the 3 newest ranked
PROMPT_LEN, NEW_TOKENS = 1278, 4  # 19 complete blocks; the step at 1280 completes block 19, summarized at decode


def test_a_registered_toy_selector_is_served_by_its_own_state(model_dir, essay_ids, tmp_path):
    args = ["--sas-selector-module", "tests.toy_selector", "--sas-selector", "toy-recency",
            "--sas-budget", str(BUDGET), "--sas-sink-blocks", "1", "--sas-local-blocks", "0",
            "--dtype", "bfloat16" if ON_GPU else "float32"]
    if ON_GPU:
        args.append("--disable-cuda-graph")  # the selection log reads the host each step
    prompt = essay_ids[9000 : 9000 + PROMPT_LEN]
    env = {"SAS_DEBUG_DIR": str(tmp_path), "PYTHONPATH": str(REPO)}
    with Server(model_dir, backend="sas", extra_args=args, env=env) as server:
        out = generate(server.url, prompt, NEW_TOKENS)
        info = requests.get(f"{server.url}/sas/info", timeout=60).json()
        log = server.log_text()
    assert info["config"]["selector"] == "toy-recency" and "gate" not in info
    # Its pages carry validity marks (it keeps summaries), and a colocated server fills every page through an
    # extend or a decode step, which mark it: none is summarized late (tests/test_summary_marks.py: when one is).
    assert "summary validity marks (host): pages handed out by alloc/alloc_extend/alloc_decode lose theirs" in log
    assert info["pool"][0]["late_summaries"] == 0, info["pool"]
    records = [json.loads(line) for f in sorted(tmp_path.glob("*.jsonl")) for line in f.open()]
    assert len(records) >= NEW_TOKENS - 1
    k = BUDGET // BLOCK
    for rec in records:  # the sink, then the newest complete blocks by the positions the pages hold
        n_cand = rec["num_candidates"][0]
        for head in rec["selected"][0]:
            assert [m for m in head if m >= 0] == [0] + list(range(n_cand - k + 1, n_cand)), rec
    assert any(rec["num_candidates"][0] == PROMPT_LEN // BLOCK + 1 for rec in records)  # a decode-written page
    rule = Rule(budget=BUDGET, sparse_from=PROMPT_LEN, selector="sink-local", block_size=BLOCK)
    oracle_check(prompt, out, records, model_dir, rule, NEW_TOKENS)
