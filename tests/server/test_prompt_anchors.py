"""--sas-prompt-anchors through a real server: each request's anchors are the blocks its last prompt token
attended most, forced into every decode step's selection, and the decode equals the transformers oracle
run with the same anchors (`hf.sparse_eval.prompt_anchors`); under `--tp-size 3` each rank anchors its own kv head as
tp1 does."""

from __future__ import annotations

import json

import pytest
import torch

from sas_backend.server_harness import ON_GPU, Server, complete, cpu_threads_bind
from tests.server.oracle import oracle_check

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
        out = complete(server.url, prompt, max_tokens=NEW_TOKENS, logprobs=1, return_token_ids=True)["choices"][0]
        log = server.log_text()
    records = [json.loads(line) for f in sorted(debug.glob("*.jsonl")) for line in f.open()]
    return prompt, out, records, log


def _reference_anchors(model_dir, prompt):
    from transformers import AutoModelForCausalLM, DynamicCache

    from sas_backend.hf.sparse_eval import prompt_anchors

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(torch.tensor([prompt]), past_key_values=cache, use_cache=True, logits_to_keep=1)
    return prompt_anchors(model, prompt, cache, ANCHORS, window=1, block_size=BLOCK)


def test_anchors_are_the_last_prompt_tokens_blocks_and_are_always_selected(anchored_run, model_dir):
    prompt, _, records, log = anchored_run
    assert "prompt anchors 2" in log  # the server says what it forces
    assert len(records) >= NEW_TOKENS - 1
    want = _reference_anchors(model_dir, prompt)[0].tolist()  # layer 0, [H_kv, R]
    n_prompt_cand = (PROMPT_LEN - 1) // BLOCK
    for rec in records:
        anchors = rec["anchors"][0]
        if not ON_GPU:  # bf16 on GPU may order near-equal blocks differently
            assert anchors == want
        for head_anchors, head_selected in zip(anchors, rec["selected"][0]):
            assert len(head_anchors) == ANCHORS and all(0 <= m < n_prompt_cand for m in head_anchors)
            assert set(head_anchors) <= set(head_selected)
            assert head_selected[0] == 0 and rec["num_candidates"][0] - 1 in head_selected  # sink and local kept


def test_anchored_decode_matches_the_oracle_with_the_same_anchors(anchored_run, model_dir, seed_gate):
    from sas_backend.gate.checkpoint import load_gate_checkpoint
    from sas_backend.gate.module import gates_from_tensors
    from sas_backend.hf.sparse_eval import SparseEvalSpec

    prompt, out, records, _ = anchored_run
    gate_cfg, layers = load_gate_checkpoint(seed_gate)
    gates = gates_from_tensors(layers, range(gate_cfg.num_hidden_layers), gate_dim=gate_cfg.gate_dim)
    spec = SparseEvalSpec(top_k=BUDGET // BLOCK, block_size=BLOCK, gates=gates, sparse_from=PROMPT_LEN,
                          sink_blocks=1, local_blocks=1, anchors=_reference_anchors(model_dir, prompt))
    oracle_check(prompt, out, records, model_dir, spec, PROMPT_LEN)


@pytest.mark.skipif(ON_GPU, reason="one GPU here: the multi-GPU tier would run --tp on several GPUs")
def test_tp3_ranks_anchor_their_own_kv_head_as_tp1_does(anchored_run, model_dir, seed_gate, tmp_path):
    """`--tp-size 3` (one of the default model's 3 kv heads per rank): each rank computes its own head's anchors
    from its own q and K at the prompt's end; they, the selections and the decode equal the tp1 server's."""
    from tests.server.test_tensor_parallel import _records

    prompt, ref, ref_records, _ = anchored_run
    args = [*_anchored_args(seed_gate), "--tp-size", "3"]
    env = {"SAS_DEBUG_DIR": str(tmp_path), "SGLANG_CPU_OMP_THREADS_BIND": cpu_threads_bind(3)}
    with Server(model_dir, backend="sas", extra_args=args, env=env) as server:
        out = complete(server.url, prompt, max_tokens=NEW_TOKENS, logprobs=1, return_token_ids=True)["choices"][0]
    assert out["token_ids"] == ref["token_ids"] and len(out["token_ids"]) == NEW_TOKENS
    worst = max(abs(a - b) for a, b in zip(ref["logprobs"]["token_logprobs"], out["logprobs"]["token_logprobs"]))
    assert worst < 2e-3, worst
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
