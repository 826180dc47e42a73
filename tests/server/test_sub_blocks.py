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
from tests.server.compare import decode_from_response, generate
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
    assert f"{SUB_BLOCKS} summaries a block, exact rerank 1; summary pool" in log, log[-3000:]
    assert f"x {dims} dims" in log, log[-3000:]


# The candidate configurations of issue 63 (the gate, 4 sub-block summaries, 2 prompt anchors, and the exact second
# level, --sas-exact-rerank 2, over 4-bit key codes, --sas-rerank-keys int4, since 2026-12-07) under the serving
# features a sub-block pool meets: tensor parallelism (--tp-size 3: each rank summarizes, encodes, anchors, selects and
# reranks its own kv head's blocks), chunked prefill (--chunked-prefill-size 256:
# a 1278-token prompt extends in 5 chunks, each summarizing the blocks it completes) and the radix cache (a second
# prompt sharing the first's 16 leading blocks reuses their pages and their sub-block summaries). Both requests'
# decodes, every rank's selections and anchors equal the oracle's (one server; the ranks' logs merged per step into
# one record over the 3 kv heads).
TP_BUDGET, TP_ANCHORS, SHARED = 384, 2, 1024


def _merged_records(debug, skip: int = 0) -> list:
    """Per decode step (after the first `skip` steps), one record over every kv head from the ranks' logs."""
    by_rank = {}
    for f in sorted(debug.glob("*.jsonl")):
        recs = [json.loads(line) for line in f.open()]
        by_rank[tuple(recs[0]["kv_heads"])] = recs
    heads = sorted(by_rank)
    steps = len(by_rank[heads[0]])
    assert all(len(r) == steps for r in by_rank.values()), {h: len(r) for h, r in by_rank.items()}
    merged = []
    for i in range(skip, steps):
        recs = [by_rank[h][i] for h in heads]
        assert len({json.dumps(r["seq_lens"]) for r in recs}) == 1
        merged.append(dict(recs[0], kv_heads=[h for hs in heads for h in hs],
                           selected=[[row for r in recs for row in r["selected"][0]]],
                           **({"anchors": [[row for r in recs for row in r["anchors"][0]]]} if "anchors" in recs[0]
                              else {})))
    return merged


def test_sub_blocks_under_tp3_chunked_prefill_and_radix_match_the_oracle(model_dir, seed_gate, essay_ids, tmp_path):
    if ON_GPU:
        pytest.skip("one GPU here: the multi-GPU tier would run --tp on several GPUs")
    from sas_backend.testing.server import cpu_threads_bind

    args = ["--sas-gate", str(seed_gate), "--sas-budget", str(TP_BUDGET), "--sas-sink-blocks", "1",
            "--sas-local-blocks", "1", "--sas-prompt-anchors", str(TP_ANCHORS), "--sas-sub-blocks", str(SUB_BLOCKS),
            "--sas-exact-rerank", "2", "--sas-rerank-keys", "int4", "--chunked-prefill-size", "256", "--tp-size", "3",
            "--dtype", "float32"]
    env = {"SAS_DEBUG_DIR": str(tmp_path), "SGLANG_CPU_OMP_THREADS_BIND": cpu_threads_bind(3)}
    first = essay_ids[9000: 9000 + PROMPT_LEN]
    second = first[:SHARED] + essay_ids[20000: 20000 + PROMPT_LEN - SHARED]  # 16 shared blocks, then new text
    rule = Rule(budget=TP_BUDGET, sparse_from=PROMPT_LEN, gate=seed_gate, sink_blocks=1, local_blocks=1,
                prompt_anchors=TP_ANCHORS, block_size=BLOCK, sub_blocks=SUB_BLOCKS, exact_rerank=2, rerank_keys="int4")
    with Server(model_dir, backend="sas", extra_args=args, env=env) as server:
        out_a = generate(server.url, first, NEW_TOKENS)
        seen = len(_merged_records(tmp_path))
        body = {"input_ids": second, "return_logprob": True, "top_logprobs_num": 2,
                "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}}
        resp = requests.post(f"{server.url}/generate", json=body, timeout=900)
        resp.raise_for_status()
        out_b = decode_from_response(resp.json())
        cached = resp.json()["meta_info"].get("cached_tokens", 0)
        info = requests.get(f"{server.url}/sas/info", timeout=60).json()
    assert cached >= SHARED, cached  # the shared blocks' pages (and their run summaries) came from the radix cache
    assert info["config"]["sub_blocks"] == SUB_BLOCKS and info["config"]["exact_rerank"] == 2
    assert info["config"]["rerank_keys"] == "int4"
    oracle_check(first, out_a, _merged_records(tmp_path)[:seen], model_dir, rule, NEW_TOKENS)
    oracle_check(second, out_b, _merged_records(tmp_path, skip=seen), model_dir, rule, NEW_TOKENS)
