"""Smoke test on the newest SGLang release, so the next API drift fails in CI, not on a user's GPU.

The full suite runs on one release (the installer's default); this file runs only in a second virtual
environment holding the newest release (`tests/run.sh` installs it and runs this file there;
`SAS_SKIP_NEWEST=1` skips that). Anywhere else the whole module is skipped.

One `sas` server with the shipped gate at a 256-token budget (K = 4 blocks): a short completion, a ~1.5K-token
prompt decoded sparsely (the selection log shows 4 of ~23 blocks per kv head), `/sas/info`; then SGLang's
dense torch-native server (FlashInfer on GPU) on the same release must give the same greedy tokens as `sas`
for a prompt that stays within K complete blocks, where the selection takes every block, i.e. is exactly
dense: within compare.KERNELS with sas's own prefill. The sas server runs with SAS_FORCE_SPARSE=1, so that
case goes through the selection and the sparse attention on the new release too (without it a step with at
most K candidates is handed to the wrapped dense backend, and the comparison would check only the routing).
The servers run one after the other, beside the main suite. (Until 2026-12-02 a third server, sas with
SGLang's own CPU prefill, checked that case bit for bit; the main suite does so on the default release:
tests/server/test_dense_equivalence.py. Its start-up was a minute of CI's two cores.)

NEWEST_SGLANG / NEWEST_TORCH are the only place naming the newest release: `tests/run.sh` reads them from this
file (keep each on one line, `NAME = "x.y.z"`).
"""

from __future__ import annotations

import json
import time

import pytest
import requests

NEWEST_SGLANG = "0.5.23"
NEWEST_TORCH = "2.14.1"  # the torch that SGLang release pins (CPU recipe of serve/install.sh)

import sglang  # noqa: E402

if sglang.__version__ != NEWEST_SGLANG:
    pytest.skip(
        f"newest-release smoke test: runs under sglang {NEWEST_SGLANG} (tests/run.sh), this is {sglang.__version__}",
        allow_module_level=True,
    )

from .compare import KERNELS, assert_same_decodes, generate  # noqa: E402
from .conftest import DENSE_ARGS  # noqa: E402
from sas_backend.testing.server import ON_GPU, Server, complete  # noqa: E402

pytestmark = pytest.mark.newest_sglang

BLOCK = 64
BUDGET = 256  # K = 4 blocks per (request, kv head)
LONG_PROMPT = 1500  # ~23 complete blocks: sparse selection runs at every decode step
DENSE_PROMPT = 150  # + NEW_TOKENS stays within K complete blocks: selection takes all, i.e. dense
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def newest_run(model_dir, shipped_gate, essay_ids, tmp_path_factory):
    """Everything the tests check, gathered with one server up at a time."""
    debug_dir = tmp_path_factory.mktemp("sas-debug-newest")
    long_prompt = essay_ids[20000 : 20000 + LONG_PROMPT]
    dense_prompt = essay_ids[30000 : 30000 + DENSE_PROMPT]
    args = dict(max_tokens=NEW_TOKENS, logprobs=2, return_token_ids=True)
    run = {"timings": {}}

    sas_args = ["--sas-gate", shipped_gate, "--sas-budget", BUDGET, "--enable-cache-report"]
    if ON_GPU:  # the selection log reads the host every step
        sas_args.append("--disable-cuda-graph")
    t0 = time.time()
    env = {"SAS_DEBUG_DIR": str(debug_dir), "SAS_FORCE_SPARSE": "1"}
    with Server(model_dir, backend="sas", extra_args=sas_args, env=env) as s:
        run["timings"]["sas_startup_s"] = time.time() - t0
        run["short"] = complete(s.url, "The capital of France is", max_tokens=8)["choices"][0]
        # The selection log, for the long prompt only.
        for f in debug_dir.glob("*.jsonl"):
            f.unlink()
        run["long"] = complete(s.url, long_prompt, **args)["choices"][0]
        run["records"] = [json.loads(line) for f in sorted(debug_dir.glob("*.jsonl")) for line in f.open()]
        run["sas_dense_case"] = generate(s.url, dense_prompt, NEW_TOKENS)
        run["info"] = requests.get(f"{s.url}/sas/info", timeout=30).json()
        run["sas_log"] = s.log_text()
        assert s.alive(), s.log_tail()

    t0 = time.time()
    dense_backend = "flashinfer" if ON_GPU else "torch_native"
    with Server(model_dir, backend=dense_backend, extra_args=DENSE_ARGS) as s:
        run["timings"]["dense_startup_s"] = time.time() - t0
        run["dense"] = generate(s.url, dense_prompt, NEW_TOKENS)
    print("newest-release smoke timings:", run["timings"])
    return run


def test_short_completion(newest_run):
    assert newest_run["short"]["text"].strip(), newest_run["short"]


def test_long_prompt_decodes_sparsely(newest_run):
    out, records = newest_run["long"], newest_run["records"]
    assert out["text"].strip() and len(out["token_ids"]) == NEW_TOKENS, out
    assert len(records) >= NEW_TOKENS - 1, len(records)  # one record per decode step
    k = BUDGET // BLOCK
    for rec in records:
        n_cand = rec["num_candidates"][0]
        assert n_cand == (rec["seq_lens"][0] - 1) // BLOCK > k
        for head in rec["selected"][0]:
            chosen = [m for m in head if m >= 0]
            assert len(chosen) == k and all(0 <= m < n_cand for m in chosen), chosen


def test_sas_info(newest_run):
    info = newest_run["info"]
    assert info["active"] is True
    assert info["config"]["budget"] == BUDGET and info["config"]["block_size"] == BLOCK
    assert info["gate"]["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert "sas: gate selector, 30 sparse layers" in newest_run["sas_log"]


def test_within_budget_equals_dense_backend(newest_run):
    """Within K blocks the selection takes every block, and the sparse path runs anyway (SAS_FORCE_SPARSE). The
    sas server runs its own prefill (ops/extend on CPU, FlashInfer on GPU): the same tokens and logprobs as dense
    within compare.KERNELS (on GPU up to a reported near tie)."""
    assert "sas: SAS_FORCE_SPARSE" in newest_run["sas_log"]
    sas, dense = newest_run["sas_dense_case"], newest_run["dense"]
    assert_same_decodes(dense, sas, KERNELS, "newest release: sas within budget vs dense", n=NEW_TOKENS)
    if not ON_GPU:
        assert "sas: CPU extend attention by sas (ops/extend)" in newest_run["sas_log"]


def test_fp8_kv_cache(model_dir, seed_gate, essay_ids, tmp_path_factory):
    """`--kv-cache-dtype fp8_e4m3` with per-layer scales on the newest release (CPU: the fp8 pool hook,
    backend/cpu_fp8_pool.py, against that release's check): its scales reported, a sparse decode of ~1.5K tokens
    as the fp8 oracle states it (tests/server/test_fp8_kv.py's check, which the main suite runs at length)."""
    if ON_GPU:
        pytest.skip("the CPU fp8 pool; CUDA serves fp8 through FlashInfer, checked by the GPU kit")
    from .test_fp8_kv import BUDGET as FP8_BUDGET, LAYERS, _check_against_oracle, _rule, _scales_file

    args = ["--sas-gate", seed_gate, "--sas-budget", str(FP8_BUDGET), "--sas-sink-blocks", "1", "--sas-local-blocks",
            "1", "--dtype", "float32", "--kv-cache-dtype", "fp8_e4m3",
            "--quantization-param-path", _scales_file(tmp_path_factory.mktemp("kv-scales-newest"))]
    prompt = essay_ids[20000 : 20000 + LONG_PROMPT]
    with Server(model_dir, backend="sas", extra_args=args) as s:
        kv = requests.get(f"{s.url}/sas/info", timeout=30).json()["pool"][0]["kv_cache"]
        out = generate(s.url, prompt, NEW_TOKENS)
    assert kv["dtype"] == "float8_e4m3fn" and kv["scales"]["sources"] == {"quantization-param-path": LAYERS}, kv
    _check_against_oracle(out, prompt, model_dir, _rule(seed_gate, len(prompt)))


def test_pd_anchor_hooks():
    """The PD metadata functions the prompt anchors' transfer wraps (backend/pd_anchors.py) exist in this release,
    and its MetadataBuffers take the hooks as the default release's do (tests/test_pd_anchors.py, run here)."""
    from sas_backend.backend import pd_anchors
    from tests import test_pd_anchors

    assert pd_anchors.hooks_available()
    test_pd_anchors.test_both_sides_register_one_more_buffer_last_of_the_same_width()
    test_pd_anchors.test_prefill_row_reaches_the_decode_pool()
