"""--sas-prompt-anchors through a real server: each request's anchors are the blocks its last prompt token
attended most, forced into every decode step's selection, and the anchors, selections and decode equal those of
the independent oracle (tests/server/oracle.py, which states the anchor rule itself); and tensor parallelism: under
`--tp-size 3` the same tokens and logprobs as tp1, and each rank selects and anchors its own kv head as tp1 does
(this module holds the suite's one tp3 server)."""

from __future__ import annotations

import json

import pytest

from sas_backend.testing.server import ON_GPU, Server, cpu_threads_bind
from tests.server.compare import FP32, assert_same_decodes, generate
from tests.server.memory_check import assert_held_as_reserved
from tests.server.oracle import Rule, oracle_check, run_oracle

PROMPT_LEN = 1500  # 23 candidate blocks, K = 6 (2500 until 2026-12-02: the prefill and oracle cost CI a minute)
NEW_TOKENS = 6
BUDGET = 384  # K = 6: sink 1 + local 1 + 2 anchors + 2 the gate ranks
ANCHORS = 2
BLOCK = 64


def _anchored_args(seed_gate) -> list:
    args = [
        "--sas-gate", seed_gate, "--sas-budget", str(BUDGET), "--sas-sink-blocks", "1", "--sas-local-blocks", "1",
        "--sas-prompt-anchors", str(ANCHORS), "--dtype", "bfloat16" if ON_GPU else "float32",
    ]
    if ON_GPU:  # the selection log reads the host each step
        args.append("--disable-cuda-graph")
    return args


@pytest.fixture(scope="module")
def anchored_run(model_dir, seed_gate, essay_ids, tmp_path_factory):
    debug = tmp_path_factory.mktemp("sas-anchor-debug")
    args = _anchored_args(seed_gate)
    prompt = essay_ids[9000 : 9000 + PROMPT_LEN]
    with Server(model_dir, backend="sas", extra_args=args, env={"SAS_DEBUG_DIR": str(debug)}) as server:
        out = generate(server.url, prompt, NEW_TOKENS)
        log = server.log_text()
        # the anchor pool (and, on CPU with the shipped settings, nothing else new) as reserved
        assert assert_held_as_reserved(server.url, exact=not ON_GPU)["held"]["prompt anchors"] > 0
    records = [json.loads(line) for f in sorted(debug.glob("*.jsonl")) for line in f.open()]
    return prompt, out, records, log


def _rule(seed_gate) -> Rule:
    return Rule(budget=BUDGET, sparse_from=PROMPT_LEN, gate=seed_gate, sink_blocks=1, local_blocks=1,
                prompt_anchors=ANCHORS, block_size=BLOCK)


@pytest.fixture(scope="module")
def anchored_oracle(anchored_run, model_dir, seed_gate):
    """The oracle over the anchored run's prompt and tokens (its anchors, selections and logprobs)."""
    prompt, out, _, _ = anchored_run
    return run_oracle(model_dir, _rule(seed_gate), prompt, out.token_ids)


def test_anchors_are_the_last_prompt_tokens_blocks_and_are_always_selected(anchored_run, anchored_oracle):
    _, _, records, log = anchored_run
    assert "prompt anchors 2" in log  # the server says what it forces
    assert len(records) >= NEW_TOKENS - 1
    want = anchored_oracle.anchors[0]  # layer 0, [H_kv][R]
    n_prompt_cand = (PROMPT_LEN - 1) // BLOCK
    for rec in records:
        anchors = rec["anchors"][0]
        if not ON_GPU:  # bf16 on GPU may order near-equal blocks differently
            assert anchors == want
        for head_anchors, head_selected in zip(anchors, rec["selected"][0]):
            assert len(head_anchors) == ANCHORS and all(0 <= m < n_prompt_cand for m in head_anchors)
            assert set(head_anchors) <= set(head_selected)
            assert head_selected[0] == 0 and rec["num_candidates"][0] - 1 in head_selected  # sink and local kept


def test_anchored_decode_matches_the_oracle_with_the_same_anchors(anchored_run, anchored_oracle, model_dir, seed_gate):
    prompt, out, records, _ = anchored_run
    oracle_check(prompt, out, records, model_dir, _rule(seed_gate), NEW_TOKENS, oracle=anchored_oracle)


def _records_by_heads(debug_dir):
    """Selection records per kv head set: {tuple(kv_heads): [record per step]} (one file per rank)."""
    by_heads = {}
    for f in sorted(debug_dir.glob("*.jsonl")):
        recs = [json.loads(line) for line in f.open()]
        assert recs and len({tuple(r["kv_heads"]) for r in recs}) == 1, f
        by_heads[tuple(recs[0]["kv_heads"])] = recs
    return by_heads


# Tensor parallelism on CPU: `--tp-size 3` serves the default model (9 q / 3 kv heads: one kv head per rank) with
# the sas backend exactly as `--tp-size 1` does, each rank selecting for its own kv head and computing its own head's
# anchors from its own q and K at the prompt's end. The gate is sharded along its kv-head axis like the model's kv
# heads. SGLang's CPU engine needs one OpenMP core set per rank (`SGLANG_CPU_OMP_THREADS_BIND`, entries separated by
# `|`); without it SGLang asserts ranks <= NUMA nodes. The three ranks share the cores this test may run on ("0|1|0"
# on a 2-core machine run serially; "0|0|0" in an xdist worker that has one core: tests/conftest.py). One tp3 server,
# anchored (so the anchors are checked too; the plain sparse case is the same path with no anchor forced).
@pytest.fixture(scope="module")
def tp3_run(anchored_run, model_dir, seed_gate, tmp_path_factory):
    if ON_GPU:
        pytest.skip("one GPU here: the multi-GPU tier would run --tp on several GPUs")
    prompt = anchored_run[0]
    debug = tmp_path_factory.mktemp("sas-anchor-debug-tp3")
    args = [*_anchored_args(seed_gate), "--tp-size", "3"]
    env = {"SAS_DEBUG_DIR": str(debug), "SGLANG_CPU_OMP_THREADS_BIND": cpu_threads_bind(3)}
    with Server(model_dir, backend="sas", extra_args=args, env=env) as server:
        out = generate(server.url, prompt, NEW_TOKENS)
    return out, _records_by_heads(debug)


def test_tp3_greedy_tokens_and_logprobs_equal_tp1(anchored_run, tp3_run):
    assert_same_decodes(anchored_run[1], tp3_run[0], FP32, "anchored tp3 vs tp1", n=NEW_TOKENS)


def test_tp3_each_rank_selects_for_its_own_kv_head_as_tp1_does(anchored_run, tp3_run):
    """Three logs, one per rank, each for one global kv head; per step, rank r's selection is tp1's selection of
    head r (sparse: K of the candidate blocks)."""
    ref_records, by_heads = anchored_run[2], tp3_run[1]
    assert sorted(by_heads) == [(0,), (1,), (2,)]
    for (head,), steps in by_heads.items():
        assert len(steps) == len(ref_records) >= NEW_TOKENS - 1
        for step, (rec, want) in enumerate(zip(steps, ref_records)):  # one request: [0] of [B][H_kv][...]
            assert rec["kv_heads"] == [head] and rec["seq_lens"] == want["seq_lens"]
            (sel,) = rec["selected"][0]
            assert len([m for m in sel if m >= 0]) == BUDGET // BLOCK < rec["num_candidates"][0]
            assert rec["selected"][0] == [want["selected"][0][head]], f"step {step}, kv head {head}"


def test_tp3_ranks_anchor_their_own_kv_head_as_tp1_does(anchored_run, tp3_run):
    ref_records, by_heads = anchored_run[2], tp3_run[1]
    for (head,), steps in by_heads.items():
        for step, (rec, want) in enumerate(zip(steps, ref_records)):
            assert rec["anchors"][0] == [want["anchors"][0][head]], f"step {step}, kv head {head}"


def test_anchors_need_room_in_the_budget():
    from sas_backend.config import SASConfig, SASConfigError

    with pytest.raises(SASConfigError, match="prompt anchor"):
        SASConfig(gate_path="g", budget=256, sink_blocks=1, local_blocks=1, prompt_anchors=3).validate()
    with pytest.raises(SASConfigError, match="ranking selector"):
        SASConfig(selector="sink-local", budget=256, prompt_anchors=1).validate()
    with pytest.raises(SASConfigError, match="prompt_anchors must be >= 0"):
        SASConfig(gate_path="g", budget=256, prompt_anchors=-1).validate()
    SASConfig(gate_path="g", budget=256, sink_blocks=1, local_blocks=1, prompt_anchors=2).validate()
