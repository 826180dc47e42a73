"""`--sas-selector quest` and `--sas-selector sink-local`: a model served sparse with no trained gate,
each checked against the independent oracle (tests/server/oracle.py, which states each selector's rule itself)
exactly as the gate is in test_sparse_decode.py."""

from __future__ import annotations

import json

import pytest

import requests

from sas_backend.testing.server import ON_GPU, Server
from tests.server.compare import generate
from tests.server.oracle import Rule, oracle_check

BLOCK = 64
PROMPT_LEN = 1300  # 20 complete blocks, K = 4 of them
NEW_TOKENS = 4
BUDGET = 256


@pytest.mark.parametrize("selector", ["quest", "sink-local"])
def test_training_free_selector_matches_oracle(selector, model_dir, essay_ids, tmp_path):
    args = ["--sas-selector", selector, "--sas-budget", str(BUDGET), "--dtype", "bfloat16" if ON_GPU else "float32"]
    if ON_GPU:
        args.append("--disable-cuda-graph")  # the selection log reads the host each step
    prompt = essay_ids[9000 : 9000 + PROMPT_LEN]
    with Server(model_dir, backend="sas", extra_args=args, env={"SAS_DEBUG_DIR": str(tmp_path)}) as server:
        out = generate(server.url, prompt, NEW_TOKENS)
        info = requests.get(f"{server.url}/sas/info", timeout=60).json()
    records = [json.loads(line) for f in sorted(tmp_path.glob("*.jsonl")) for line in f.open()]
    assert len(records) >= NEW_TOKENS - 1
    k = BUDGET // BLOCK
    for rec in records:  # really sparse: K of the candidates per kv head
        n_cand = rec["num_candidates"][0]
        for head in rec["selected"][0]:
            chosen = [m for m in head if m >= 0]
            assert len(chosen) == k < n_cand
            if selector == "sink-local":  # block 0 and the K-1 blocks before the current one
                assert chosen == [0] + list(range(n_cand - k + 1, n_cand))
    assert info["config"]["selector"] == selector and "gate" not in info
    rule = Rule(budget=BUDGET, sparse_from=PROMPT_LEN, selector=selector, block_size=BLOCK)
    oracle_check(prompt, out, records, model_dir, rule, NEW_TOKENS)
