"""`--sas-sub-blocks 4`: the gate and quest summarize each 16-token run of a 64-token block on its own and rank a
block by its best run (keeps needle-like keys; docs/design.md). Served on CPU and checked against the independent
oracle (tests/server/oracle.py states the run rule itself), with a decode-made block ranked, exactly as the
one-summary selectors are in test_sparse_decode.py / test_training_free_selectors.py; /sas/info reports it and the
summary pool is 4x as wide. Quest here (Llama); the gate with sub-blocks is served on Qwen3 in test_qwen3.py (one
server fewer in CI: both ran and passed here on 2026-12-05, 4 passed in 190 s)."""

from __future__ import annotations

import json

import pytest
import requests

from sas_backend.testing.server import ON_GPU, Server
from tests.server.compare import generate
from tests.server.oracle import Rule, oracle_check

BLOCK = 64
SUB_BLOCKS = 4
PROMPT_LEN = 1278  # 19 complete blocks, K = 4: the step at seq_len 1280 completes block 19 (its runs summarized at
NEW_TOKENS = 5  # decode), which the steps from 1281 rank
BUDGET = 256


@pytest.fixture(scope="module", params=["quest"])
def sub_run(request, model_dir, seed_gate, essay_ids, tmp_path_factory):
    selector = request.param
    debug = tmp_path_factory.mktemp(f"sas-debug-sub-{selector}")
    args = ["--sas-selector", selector, "--sas-budget", str(BUDGET), "--sas-sub-blocks", str(SUB_BLOCKS),
            "--sas-sink-blocks", "1", "--sas-local-blocks", "1", "--dtype", "bfloat16" if ON_GPU else "float32"]
    if selector == "gate":
        args += ["--sas-gate", str(seed_gate)]
    if ON_GPU:
        args.append("--disable-cuda-graph")  # the selection log reads the host each step
    prompt = essay_ids[9000 : 9000 + PROMPT_LEN]
    with Server(model_dir, backend="sas", extra_args=args, env={"SAS_DEBUG_DIR": str(debug)}) as server:
        out = generate(server.url, prompt, NEW_TOKENS)
        info = requests.get(f"{server.url}/sas/info", timeout=60).json()
        log = server.log_text()
    records = [json.loads(line) for f in sorted(debug.glob("*.jsonl")) for line in f.open()]
    return {"selector": selector, "prompt": prompt, "out": out, "info": info, "log": log, "records": records}


def test_sub_block_selection_matches_the_oracle(sub_run, model_dir, seed_gate):
    selector, prompt, out, records = (sub_run[k] for k in ("selector", "prompt", "out", "records"))
    assert len(records) >= NEW_TOKENS - 1
    for rec in records:  # really sparse: K of the candidates per kv head
        for head in rec["selected"][0]:
            assert len([m for m in head if m >= 0]) == BUDGET // BLOCK < rec["num_candidates"][0]
    assert any(rec["num_candidates"][0] >= PROMPT_LEN // BLOCK + 1 for rec in records)  # a decode-made block ranked
    gate = seed_gate if selector == "gate" else None
    rule = Rule(budget=BUDGET, sparse_from=PROMPT_LEN, selector=selector, gate=gate, sink_blocks=1, local_blocks=1,
                block_size=BLOCK, sub_blocks=SUB_BLOCKS)
    oracle_check(prompt, out, records, model_dir, rule, NEW_TOKENS)


def test_sub_blocks_are_reported_and_reserved(sub_run):
    info, log = sub_run["info"], sub_run["log"]
    assert info["config"]["sub_blocks"] == SUB_BLOCKS
    dims = {"gate": 128, "quest": 2 * 64}[sub_run["selector"]] * SUB_BLOCKS  # the seed gate: Dg 128; D 64
    assert f"{SUB_BLOCKS} summaries a block; summary pool" in log and f"x {dims} dims" in log, log[-3000:]
