"""`--sas-exact-rerank 2` (two levels, issue 63): the gate picks 2 x K blocks (sink, local and the prompt anchor in),
and the K of highest exact attention mass among them are attended. Served on CPU and checked against the
independent oracle (tests/server/oracle.py states the second level itself: the picked blocks' keys, each query
head's softmax over them, a block's mass max over the group), under chunked prefill and the radix cache (a second
prompt sharing the first's 16 leading blocks); the one-level oracle selects differently, so the check can fail.
Speculative verify: an NGRAM server with the same flags decodes the same tokens (every verify row reranks as the
decode step at its position would). /sas/info and the log report it; its buffers are held as reserved. TP: the
sub-block TP3 test (test_sub_blocks.py) serves it too; the fused Triton path: test_qwen3.py."""

from __future__ import annotations

import dataclasses
import json

import pytest
import requests

from sas_backend.testing.server import ON_GPU, Server
from tests.server.compare import FP32, assert_same_decodes, decode_from_response, generate
from tests.server.memory_check import assert_held_as_reserved
from tests.server.oracle import Rule, oracle_check, run_oracle
from tests.server.test_speculative_dense import DRAFT_TOKENS, NGRAM_ARGS

pytestmark = pytest.mark.skipif(ON_GPU, reason="the CPU path (fp32 selections compared exactly)")

BLOCK = 64
PROMPT_LEN = 1278  # 19 complete blocks; K = 6 of them, from the 12 the gate picks
NEW_TOKENS = 5
BUDGET = 384
RERANK = 2
SHARED = 1024
ARGS = ["--sas-budget", str(BUDGET), "--sas-sink-blocks", "1", "--sas-local-blocks", "1", "--sas-prompt-anchors", "1",
        "--sas-exact-rerank", str(RERANK), "--dtype", "float32"]


def _records(debug, skip: int = 0) -> list:
    return [json.loads(line) for f in sorted(debug.glob("*.jsonl")) for line in f.open()][skip:]


def _serve_two_prompts(model_dir, seed_gate, essay_ids, debug, extra=()) -> dict:
    """One server with ARGS (and `extra`) under chunked prefill: a prompt, then a second sharing its first SHARED
    tokens (the radix cache); what the checks read."""
    first = essay_ids[9000: 9000 + PROMPT_LEN]
    second = first[:SHARED] + essay_ids[20000: 20000 + PROMPT_LEN - SHARED]
    args = ["--sas-gate", str(seed_gate), *ARGS, *extra, "--chunked-prefill-size", "256"]
    with Server(model_dir, backend="sas", extra_args=args, env={"SAS_DEBUG_DIR": str(debug)}) as server:
        out_a = generate(server.url, first, NEW_TOKENS)
        seen = len(_records(debug))
        body = {"input_ids": second, "return_logprob": True, "top_logprobs_num": 2,
                "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}}
        resp = requests.post(f"{server.url}/generate", json=body, timeout=900)
        resp.raise_for_status()
        out_b = decode_from_response(resp.json())
        info = requests.get(f"{server.url}/sas/info", timeout=60).json()
        memory = assert_held_as_reserved(server.url)
        log = server.log_text()
    return dict(prompts=(first, second), outs=(out_a, out_b), seen=seen, debug=debug, info=info, memory=memory,
                log=log, cached=resp.json()["meta_info"].get("cached_tokens", 0))


@pytest.fixture(scope="module")
def rerank_run(model_dir, seed_gate, essay_ids, tmp_path_factory):
    return _serve_two_prompts(model_dir, seed_gate, essay_ids, tmp_path_factory.mktemp("sas-debug-rerank"))


def _rule(seed_gate, rerank: int = RERANK) -> Rule:
    return Rule(budget=BUDGET, sparse_from=PROMPT_LEN, gate=seed_gate, sink_blocks=1, local_blocks=1,
                prompt_anchors=1, block_size=BLOCK, exact_rerank=rerank)


def test_two_level_decode_matches_the_oracle_under_chunked_prefill_and_radix(rerank_run, model_dir, seed_gate):
    run = rerank_run
    assert run["cached"] >= SHARED, run["cached"]  # the shared blocks' pages (and summaries) from the radix cache
    records = _records(run["debug"])
    for rec in records:  # really sparse: K of the candidates per kv head
        for head in rec["selected"][0]:
            assert len([m for m in head if m >= 0]) == BUDGET // BLOCK < rec["num_candidates"][0]
    first, second = run["prompts"]
    oracle = oracle_check(first, run["outs"][0], records[:run["seen"]], model_dir, _rule(seed_gate), NEW_TOKENS)
    oracle_check(second, run["outs"][1], records[run["seen"]:], model_dir, _rule(seed_gate), NEW_TOKENS)
    # The second level changed what was attended: the one-level gate at K picks other blocks at some step.
    one_level = run_oracle(model_dir, _rule(seed_gate, rerank=1), first, run["outs"][0].token_ids)
    assert any(oracle.selected[0][p] != one_level.selected[0][p] for p in oracle.selected[0])


def test_two_levels_are_reported_and_reserved(rerank_run):
    run = rerank_run
    assert run["info"]["config"]["exact_rerank"] == RERANK
    # on CPU the candidates' keys, gathered once, rank them and are attended (`ops.rerank.rerank_attend`)
    assert f"exact rerank {RERANK}, ranked and attended over one gather;" in run["log"], run["log"][-3000:]
    assert "by their exact attention mass (--sas-exact-rerank 2" in run["log"], run["log"][-3000:]
    assert run["memory"]["held"]["exact rerank"] > 0  # the second level's selection buffer, as reserved


def test_ngram_verify_with_two_levels_gives_the_tokens_of_decode(rerank_run, model_dir, seed_gate, tmp_path):
    args = ["--sas-gate", str(seed_gate), *ARGS, *NGRAM_ARGS]
    body = {"input_ids": list(rerank_run["prompts"]), "return_logprob": True, "top_logprobs_num": 2,
            "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}}
    with Server(model_dir, backend="sas", extra_args=args, env={"SAS_DEBUG_DIR": str(tmp_path)}) as server:
        resp = requests.post(f"{server.url}/generate", json=body, timeout=900)
        resp.raise_for_status()
    spec = [decode_from_response(o) for o in resp.json()]
    assert_same_decodes(list(rerank_run["outs"]), spec, FP32, "two levels + NGRAM vs two levels", n=NEW_TOKENS)
    records = _records(tmp_path)
    assert records and all(len(r["seq_lens"]) % DRAFT_TOKENS == 0 for r in records)  # verify steps
    for r in records:
        for row, n_cand in enumerate(r["num_candidates"]):
            for head in r["selected"][row]:
                assert len({m for m in head if m >= 0}) == min(n_cand, BUDGET // BLOCK), (r["seq_lens"], row, head)


def test_the_second_level_over_4bit_key_codes_matches_the_oracle(model_dir, seed_gate, essay_ids, tmp_path):
    """`--sas-rerank-keys int4`: the second level reads each complete block's keys from the summary pool's 4-bit codes
    (written at extend, by chunked prefill's chunks, and when a decode step completes a block; radix-shared pages keep
    theirs). Checked against the oracle stating the 4-bit rule itself (`oracle._four_bit`); codes left unwritten
    (zeros: every block's keys equal) would rank the candidates alike and fail it. Reported in /sas/info and the log;
    the codes held as reserved, inside the summary pool."""
    run = _serve_two_prompts(model_dir, seed_gate, essay_ids, tmp_path, extra=("--sas-rerank-keys", "int4"))
    assert run["cached"] >= SHARED
    records, seen, (first, second), (out_a, out_b) = _records(tmp_path), run["seen"], run["prompts"], run["outs"]
    rule = dataclasses.replace(_rule(seed_gate), rerank_keys="int4")
    oracle = oracle_check(first, out_a, records[:seen], model_dir, rule, NEW_TOKENS)
    oracle_check(second, out_b, records[seen:], model_dir, rule, NEW_TOKENS)
    # The codes were read, not the cache's keys: over exact keys the second level keeps other blocks somewhere.
    exact = run_oracle(model_dir, _rule(seed_gate), first, out_a.token_ids)
    assert any(oracle.selected[0][p] != exact.selected[0][p] for p in oracle.selected[0])
    assert run["info"]["config"]["rerank_keys"] == "int4"
    assert "exact rerank 2 over 4-bit key codes;" in run["log"], run["log"][-3000:]
    assert run["memory"]["held"]["summary pool"] > 0
