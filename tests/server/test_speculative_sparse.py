"""Speculative decoding with the sas backend on CPU: NGRAM drafts (chain), every verify step sparse.

One `sas` server with `--speculative-algorithm NGRAM` (4 draft tokens a step) and the configuration of the suite's
`sas_sparse_server` (seeded gate, budget 256: K = 4 of ~30-40 blocks, sink 1 + local 1, fp32), which is the
reference: the same server without speculation. With greedy sampling both must produce the same tokens with
logprobs within compare.FP32 (a swap only at a reported near tie): each verify row decodes as the decode step at
its position would (backend/verify_rows.py, tests/test_sparse_verify.py), its selection logged like a decode
step's. The accepted-length statistics show that speculation happened (accepted drafts, fewer verify steps than
tokens).

Two prompts in one batch (mixed lengths), each an essay passage followed by its own beginning, so that the
continuation copies the passage and NGRAM's n-grams of the prompt are often right. SAS_SPEC_PROMPT_TOKENS
(default 2000) sets the first prompt's length (the second is 256 longer) (bench/results/...-speculative ran it at 8000);
SAS_SPEC_RECORD=<file> writes the comparison as JSON.
"""

from __future__ import annotations

import json
import os
import time

import pytest
import requests

from sas_backend.testing.server import ON_GPU, Server
from tests.server.compare import FP32, assert_same_decodes, decode_from_response
from tests.server.test_speculative_dense import DRAFT_TOKENS, NGRAM_ARGS

pytestmark = pytest.mark.skipif(ON_GPU, reason="the CPU path; tests/gpu/test_speculative_gpu.py is the GPU one")

PROMPT_TOKENS = int(os.environ.get("SAS_SPEC_PROMPT_TOKENS", "2000"))
NEW_TOKENS = 20
# The suite's sas_sparse_server (tests/server/conftest.py), so that it is the reference without speculation.
SPARSE_ARGS = ["--sas-budget", "256", "--sas-sink-blocks", "1", "--sas-local-blocks", "1", "--dtype", "float32",
               "--enable-cache-report"]


def _prompts(essay_ids) -> list:
    """[first, second]: each a passage of 3/4 of its length followed by the passage's first quarter again."""
    out = []
    for start, length in ((30000, PROMPT_TOKENS), (70000, PROMPT_TOKENS + 256)):
        passage = essay_ids[start: start + length * 3 // 4]
        out.append(passage + passage[: length - len(passage)])
    return out


def _generate(url: str, prompts: list) -> list:
    """One batched /generate of greedy decodes (exactly NEW_TOKENS each) with logprobs and the top 2."""
    body = {"input_ids": prompts, "return_logprob": True, "top_logprobs_num": 2,
            "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}}
    r = requests.post(f"{url}/generate", json=body, timeout=1800)
    r.raise_for_status()
    return r.json()


@pytest.fixture(scope="module")
def ngram_sas_server(model_dir, seed_gate, tmp_path_factory):
    debug = tmp_path_factory.mktemp("sas-debug-spec")
    started = time.monotonic()
    args = ["--sas-gate", seed_gate, *SPARSE_ARGS, *NGRAM_ARGS]
    with Server(model_dir, backend="sas", extra_args=args, env={"SAS_DEBUG_DIR": str(debug)}) as s:
        s.startup_s, s.debug_dir = time.monotonic() - started, debug
        yield s


def test_ngram_sparse_verify_gives_the_tokens_of_sas_without_speculation(essay_ids, sas_sparse_server,
                                                                          ngram_sas_server):
    prompts = _prompts(essay_ids)
    t0 = time.monotonic()
    spec = _generate(ngram_sas_server.url, prompts)
    spec_s = time.monotonic() - t0
    requests.post(f"{sas_sparse_server.url}/flush_cache", timeout=60)
    t0 = time.monotonic()
    ref = _generate(sas_sparse_server.url, prompts)
    ref_s = time.monotonic() - t0
    report = assert_same_decodes([decode_from_response(o) for o in ref], [decode_from_response(o) for o in spec],
                                 FP32, f"sas + NGRAM vs sas, prompts of {[len(p) for p in prompts]} tokens",
                                 n=NEW_TOKENS)
    metas = [o["meta_info"] for o in spec]
    stats = [{k: m[k] for k in ("spec_verify_ct", "spec_accept_length", "spec_num_correct_drafts",
                                "spec_num_proposed_drafts", "spec_correct_drafts_histogram")} for m in metas]
    log = ngram_sas_server.log_text()
    records = [json.loads(line) for f in ngram_sas_server.debug_dir.glob("*.jsonl") for line in f.open()]
    print(f"\nsas + NGRAM ({DRAFT_TOKENS} drafts, chain) vs sas: {report.line()}; generate {spec_s:.1f} s vs "
          f"{ref_s:.1f} s; server start {ngram_sas_server.startup_s:.0f} s")
    for i, s in enumerate(stats):
        print(f"prompt {i} ({len(prompts[i])} tokens): {s}")
    if os.environ.get("SAS_SPEC_RECORD"):
        with open(os.environ["SAS_SPEC_RECORD"], "w") as f:
            json.dump({"prompt_tokens": [len(p) for p in prompts], "new_tokens": NEW_TOKENS,
                       "draft_tokens": DRAFT_TOKENS, "args": SPARSE_ARGS + NGRAM_ARGS, "report": report.line(),
                       "tokens_compared": report.tokens_compared, "max_logprob_diff": report.max_logprob_diff,
                       "near_ties": [vars(t) for t in report.near_ties], "speculation": stats,
                       "generate_s": {"sas_ngram": spec_s, "sas": ref_s}}, f, indent=1)
    # A request whose rows all hold at most K candidate blocks: on CPU the verify step then attends densely through
    # the wrapped torch_native backend's verify (sas_backend/dense_verify.py), the same tokens as sas's dense decode.
    short = [prompts[0][:200]]
    assert_same_decodes(decode_from_response(_generate(sas_sparse_server.url, short)[0]),
                        decode_from_response(_generate(ngram_sas_server.url, short)[0]), FP32,
                        "sas + NGRAM vs sas, 200-token prompt (dense verify steps)", n=NEW_TOKENS)
    assert "Traceback" not in log, log[-3000:]
    # Every step after the prefill was a verify step, and sparse: in the selection log each row (a draft position)
    # picks K = 4 distinct blocks of more candidates, for every kv head; a request's rows are consecutive positions.
    assert records
    for r in records:
        lens = r["seq_lens"]
        assert len(lens) % DRAFT_TOKENS == 0, lens
        for b in range(0, len(lens), DRAFT_TOKENS):
            assert lens[b: b + DRAFT_TOKENS] == list(range(lens[b], lens[b] + DRAFT_TOKENS)), lens
        for row, n_cand in enumerate(r["num_candidates"]):
            assert n_cand > 4, (lens, n_cand)
            for head in r["selected"][row]:
                picks = [m for m in head if m >= 0]
                assert len(set(picks)) == 4 and max(picks) < n_cand, (lens, row, head)
    assert max(len(r["seq_lens"]) for r in records) == DRAFT_TOKENS * len(prompts), "no batched verify step"
    # Speculation happened: drafts were accepted, and each request took fewer verify steps than tokens.
    for s in stats:
        assert s["spec_verify_ct"] > 0 and s["spec_num_proposed_drafts"] > 0, s
    assert sum(s["spec_num_correct_drafts"] for s in stats) > 0, stats
    assert sum(s["spec_verify_ct"] for s in stats) < len(prompts) * (NEW_TOKENS - 1), stats


@pytest.mark.skipif(os.environ.get("SAS_SPEC_COVERING") != "1",
                    reason="a second NGRAM server: run with SAS_SPEC_COVERING=1 (the committed 8K record does); "
                           "in CI tests/test_sparse_verify.py checks verify = decode at a covering budget")
def test_ngram_sparse_verify_at_a_covering_budget_gives_dense_tokens(essay_ids, dense_server, model_dir, shipped_gate):
    """Budget 8192 (every block selected) with SAS_FORCE_SPARSE=1, so every verify row runs the selection and the
    sparse attention: the tokens of SGLang's dense torch_native server, logprobs within compare.KERNELS."""
    from tests.server.compare import KERNELS

    prompts = _prompts(essay_ids)
    args = ["--sas-gate", shipped_gate, "--sas-budget", "8192", "--enable-cache-report", *NGRAM_ARGS]
    with Server(model_dir, backend="sas", extra_args=args, env={"SAS_FORCE_SPARSE": "1"}) as s:
        spec = _generate(s.url, prompts)
    requests.post(f"{dense_server.url}/flush_cache", timeout=60)
    dense = _generate(dense_server.url, prompts)
    report = assert_same_decodes([decode_from_response(o) for o in dense], [decode_from_response(o) for o in spec],
                                 KERNELS, f"sas + NGRAM, covering budget, vs dense, {[len(p) for p in prompts]} tokens",
                                 n=NEW_TOKENS)
    stats = [{k: o["meta_info"][k] for k in ("spec_verify_ct", "spec_accept_length", "spec_num_correct_drafts")}
             for o in spec]
    print(f"\n{report.line()}\nspeculation: {stats}")
    if os.environ.get("SAS_SPEC_RECORD"):
        path = os.environ["SAS_SPEC_RECORD"].replace(".json", "-covering.json")
        with open(path, "w") as f:
            json.dump({"prompt_tokens": [len(p) for p in prompts], "new_tokens": NEW_TOKENS, "report": report.line(),
                       "tokens_compared": report.tokens_compared, "max_logprob_diff": report.max_logprob_diff,
                       "near_ties": [vars(t) for t in report.near_ties], "speculation": stats}, f, indent=1)
    assert sum(x["spec_num_correct_drafts"] for x in stats) > 0, stats
