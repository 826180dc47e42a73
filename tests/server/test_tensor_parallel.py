"""Tensor parallelism on CPU: `--tp-size 3` serves the default model (9 q / 3 kv heads: one kv head
per rank) with the sas backend exactly as `--tp-size 1` does, each rank selecting for its own kv head.

SGLang's CPU engine needs one OpenMP core set per rank (`SGLANG_CPU_OMP_THREADS_BIND`, entries
separated by `|`); without it SGLang asserts ranks <= NUMA nodes. The three ranks share the cores this
test may run on ("0|1|0" on a 2-core machine run serially; "0|0|0" in xdist worker gw0, which has core 0
alone: tests/conftest.py). The gate is sharded along its kv-head axis like the model's kv heads.
Compared with the sparse tp1 server of test_sparse_decode.py (same gate, budget, dtype and prompt).
"""

from __future__ import annotations

import json

import pytest

from sas_backend.server_harness import ON_GPU, Server, cpu_threads_bind
from tests.server.compare import FP32, assert_same_decodes, generate
from tests.server.test_sparse_decode import BLOCK, BUDGET, NEW_TOKENS

TP = 3
# 1024 prompt tokens: 15 candidate blocks, 4 attended (sink + local + 2 chosen), still sparse; shorter than
# test_sparse_decode's prompt because the three ranks share this machine's two cores (CI time).
PROMPT_LEN = 1024


pytestmark = pytest.mark.skipif(ON_GPU, reason="one GPU here: the multi-GPU tier would run --tp on several GPUs")


def _records(debug_dir):
    """Selection records per kv head set: {tuple(kv_heads): [record per step]} (one file per rank)."""
    by_heads = {}
    for f in sorted(debug_dir.glob("*.jsonl")):
        recs = [json.loads(line) for line in f.open()]
        assert recs and len({tuple(r["kv_heads"]) for r in recs}) == 1, f
        by_heads[tuple(recs[0]["kv_heads"])] = recs
    return by_heads


@pytest.fixture(scope="module")
def tp_runs(essay_ids, model_dir, seed_gate, sas_sparse_server, sparse_debug_dir, tmp_path_factory):
    prompt = essay_ids[5000 : 5000 + PROMPT_LEN]
    for f in sparse_debug_dir.glob("*.jsonl"):
        f.unlink()
    ref = generate(sas_sparse_server.url, prompt, NEW_TOKENS)
    ref_records = _records(sparse_debug_dir)

    tp_dir = tmp_path_factory.mktemp("sas-debug-tp")
    args = [
        "--sas-gate", seed_gate, "--sas-budget", str(BUDGET), "--sas-sink-blocks", "1", "--sas-local-blocks", "1",
        "--dtype", "float32", "--tp-size", str(TP),
    ]
    env = {"SAS_DEBUG_DIR": str(tp_dir), "SGLANG_CPU_OMP_THREADS_BIND": cpu_threads_bind(TP)}
    with Server(model_dir, backend="sas", extra_args=args, env=env) as s:
        out = generate(s.url, prompt, NEW_TOKENS)
    return ref, ref_records, out, _records(tp_dir)


def test_tp3_greedy_tokens_and_logprobs_equal_tp1(tp_runs):
    ref, _, out, _ = tp_runs
    assert_same_decodes(ref, out, FP32, "tp3 vs tp1", n=NEW_TOKENS)


def test_each_rank_selects_for_its_own_kv_head_as_tp1_does(tp_runs):
    """Three logs, one per rank, each for one global kv head; per step, rank r's selection is
    tp1's selection of head r (sparse: K of the candidate blocks)."""
    _, ref_records, _, tp_records = tp_runs
    (ref_heads,) = ref_records  # tp1: one process, all three heads
    assert ref_heads == (0, 1, 2)
    assert sorted(tp_records) == [(0,), (1,), (2,)]
    ref_steps = ref_records[ref_heads]
    for (head,), steps in tp_records.items():
        assert len(steps) == len(ref_steps) >= NEW_TOKENS - 1
        for step, (rec, want) in enumerate(zip(steps, ref_steps)):
            assert rec["seq_lens"] == want["seq_lens"]
            (sel,) = rec["selected"][0]
            assert len([m for m in sel if m >= 0]) == BUDGET // BLOCK < rec["num_candidates"][0]
            assert sel == want["selected"][0][head], f"step {step}, kv head {head}"
