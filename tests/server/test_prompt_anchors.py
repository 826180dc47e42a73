"""--sas-prompt-anchors through a real server: each request's anchors are the blocks its last prompt token
attended most, forced into every decode step's selection, and the anchors, selections and decode equal those of
the independent oracle (tests/server/oracle.py, which states the anchor rule itself); under `--tp-size 3` each rank
anchors its own kv head as tp1 does."""

from __future__ import annotations

import json

import pytest

from sas_backend.server_harness import ON_GPU, Server, cpu_threads_bind
from tests.server.compare import FP32, assert_same_decodes, generate
from tests.server.oracle import Rule, oracle_check, run_oracle

PROMPT_LEN = 2500
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


@pytest.mark.skipif(ON_GPU, reason="one GPU here: the multi-GPU tier would run --tp on several GPUs")
def test_tp3_ranks_anchor_their_own_kv_head_as_tp1_does(anchored_run, model_dir, seed_gate, tmp_path):
    """`--tp-size 3` (one of the default model's 3 kv heads per rank): each rank computes its own head's anchors
    from its own q and K at the prompt's end; they, the selections and the decode equal the tp1 server's."""
    from tests.server.test_tensor_parallel import _records

    prompt, ref, ref_records, _ = anchored_run
    args = [*_anchored_args(seed_gate), "--tp-size", "3"]
    env = {"SAS_DEBUG_DIR": str(tmp_path), "SGLANG_CPU_OMP_THREADS_BIND": cpu_threads_bind(3)}
    with Server(model_dir, backend="sas", extra_args=args, env=env) as server:
        out = generate(server.url, prompt, NEW_TOKENS)
    assert_same_decodes(ref, out, FP32, "anchored tp3 vs tp1", n=NEW_TOKENS)
    by_heads = _records(tmp_path)
    assert sorted(by_heads) == [(0,), (1,), (2,)]
    for (head,), steps in by_heads.items():
        assert len(steps) == len(ref_records) >= NEW_TOKENS - 1
        for step, (rec, want) in enumerate(zip(steps, ref_records)):  # one request: [0] of [B][H_kv][...]
            assert rec["kv_heads"] == [head] and rec["seq_lens"] == want["seq_lens"]
            assert rec["anchors"][0] == [want["anchors"][0][head]], f"step {step}, kv head {head}"
            assert rec["selected"][0] == [want["selected"][0][head]], f"step {step}, kv head {head}"


def test_anchors_need_room_in_the_budget():
    from sas_backend.config import SASConfig, SASConfigError

    with pytest.raises(SASConfigError, match="prompt anchor"):
        SASConfig(gate_path="g", budget=256, sink_blocks=1, local_blocks=1, prompt_anchors=3).validate()
    with pytest.raises(SASConfigError, match="ranking selector"):
        SASConfig(selector="sink-local", budget=256, prompt_anchors=1).validate()
    with pytest.raises(SASConfigError, match="prompt_anchors must be >= 0"):
        SASConfig(gate_path="g", budget=256, prompt_anchors=-1).validate()
    SASConfig(gate_path="g", budget=256, sink_blocks=1, local_blocks=1, prompt_anchors=2).validate()
