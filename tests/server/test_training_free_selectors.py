"""`--sas-selector quest` and `--sas-selector sink-local`: a model served sparse with no trained gate,
each checked against the independent oracle (tests/server/oracle.py, which states each selector's rule itself)
exactly as the gate is in test_sparse_decode.py. The sink-local server also runs `--sas-dense-below` (on CPU),
which is selector-independent: one server start for both (until 2026-12-02 a server of its own in
test_dense_equivalence.py)."""

from __future__ import annotations

import json

import pytest

import requests

from sas_backend.testing.server import ON_GPU, Server
from tests.server.compare import KERNELS, assert_same_decodes, generate
from tests.server.oracle import Rule, oracle_check

BLOCK = 64
PROMPT_LEN = 1278  # 19 complete blocks, K = 4 of them; the decode step at seq_len 1280 completes block 19 (its
NEW_TOKENS = 4  # quest min/max made at decode), which the step at 1281 ranks
BUDGET = 256


DENSE_BELOW = 400  # the sink-local server's --sas-dense-below
SHORT_PROMPT = 300  # its steps hold at most 300 + NEW_TOKENS_SHORT <= DENSE_BELOW tokens: dense
NEW_TOKENS_SHORT = 30


@pytest.fixture(scope="module", params=["quest", "sink-local"])
def selector_run(request, model_dir, essay_ids, tmp_path_factory, dense_server):
    """One server per selector; its decode of the oracle's prompt, selection log and /sas/info; for sink-local
    on CPU also (first, so the log holds none of it) a short prompt's decode under --sas-dense-below, with
    the dense server's decode of it (a fixture of the module's, so it runs with the shared servers:
    tests/conftest.py)."""
    selector = request.param
    debug = tmp_path_factory.mktemp(f"sas-debug-{selector}")
    args = ["--sas-selector", selector, "--sas-budget", str(BUDGET), "--dtype", "bfloat16" if ON_GPU else "float32"]
    if ON_GPU:
        args.append("--disable-cuda-graph")  # the selection log reads the host each step
    dense_below = selector == "sink-local" and not ON_GPU
    if dense_below:
        args += ["--sas-dense-below", str(DENSE_BELOW)]
    prompt = essay_ids[9000 : 9000 + PROMPT_LEN]
    run = {"selector": selector, "prompt": prompt}
    with Server(model_dir, backend="sas", extra_args=args, env={"SAS_DEBUG_DIR": str(debug)}) as server:
        if dense_below:
            short = essay_ids[3100 : 3100 + SHORT_PROMPT]
            run["short"] = tuple(generate(url, short, NEW_TOKENS_SHORT) for url in (dense_server.url, server.url))
            run["short_logged"] = list(debug.glob("*.jsonl"))
        run["out"] = generate(server.url, prompt, NEW_TOKENS)
        run["info"] = requests.get(f"{server.url}/sas/info", timeout=60).json()
        run["log"] = server.log_text()
    run["records"] = [json.loads(line) for f in sorted(debug.glob("*.jsonl")) for line in f.open()]
    return run


def test_training_free_selector_matches_oracle(selector_run, model_dir):
    selector, prompt, out, records = (selector_run[k] for k in ("selector", "prompt", "out", "records"))
    assert len(records) >= NEW_TOKENS - 1
    k = BUDGET // BLOCK
    for rec in records:  # really sparse: K of the candidates per kv head
        n_cand = rec["num_candidates"][0]
        for head in rec["selected"][0]:
            chosen = [m for m in head if m >= 0]
            assert len(chosen) == k < n_cand
            if selector == "sink-local":  # block 0 and the K-1 blocks before the current one
                assert chosen == [0] + list(range(n_cand - k + 1, n_cand))
    assert selector_run["info"]["config"]["selector"] == selector and "gate" not in selector_run["info"]
    rule = Rule(budget=BUDGET, sparse_from=PROMPT_LEN, selector=selector, block_size=BLOCK)
    oracle_check(prompt, out, records, model_dir, rule, NEW_TOKENS)


def test_dense_below_decodes_short_steps_densely(selector_run):
    """--sas-dense-below 400 with a 256-token budget: a 300-token prompt's steps (at most 330 tokens) decode
    densely, as the dense server does, and select nothing; the 1278-token prompt's steps select (every one
    logged, K of the candidates: the test above)."""
    if "short" not in selector_run:
        pytest.skip("run by the sink-local server on CPU (the GPU's graph branches: tests/gpu/test_server_gpu.py)")
    dense, sas = selector_run["short"]
    assert_same_decodes(dense, sas, KERNELS, "dense-below 400 vs dense, 300-token prompt", n=NEW_TOKENS_SHORT)
    assert selector_run["short_logged"] == [], "a step under the threshold selected blocks"
    assert len(selector_run["records"]) == NEW_TOKENS  # every step of the long prompt selected
    assert "requests hold at most 400 tokens in all attend densely" in selector_run["log"]
