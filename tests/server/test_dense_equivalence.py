"""With a budget >= the context, sas decodes exactly like SGLang's dense torch-native backend."""

from __future__ import annotations

import pytest
import requests

from sas_backend.testing.server import ON_GPU, Server, complete
from sas_backend.soak.run import flush_cache
from tests.server.compare import EXACT, KERNELS, assert_same_decodes, generate
from tests.server.conftest import DENSE_ARGS

# Within one block; exactly on a block boundary; many blocks. 30 new tokens make the first
# prompt complete a block during decode (the decode-time summary update).
PROMPT_LENGTHS = [40, 128, 1500]
NEW_TOKENS = 30


def _prompt(essay_ids, length):
    offset = 1000 + 7 * length  # different text per case
    return essay_ids[offset : offset + length]


@pytest.mark.parametrize("length", PROMPT_LENGTHS)
def test_greedy_tokens_identical_to_dense(length, essay_ids, dense_server, sas_full_server):
    """The default sas server: its own prefill on CPU (ops/extend), FlashInfer's on GPU; both differ from
    the dense server's kernels in rounding only: every token and logprob within compare.KERNELS (in bf16 on
    GPU, up to a reported near tie)."""
    prompt = _prompt(essay_ids, length)
    dense = generate(dense_server.url, prompt, NEW_TOKENS)
    sas = generate(sas_full_server.url, prompt, NEW_TOKENS)
    assert_same_decodes(dense, sas, KERNELS, f"sas budget 8192 vs dense, {length}-token prompt", n=NEW_TOKENS)


@pytest.mark.skipif(ON_GPU, reason="CPU: the same torch ops as the dense server, so bit-identical")
def test_with_sglang_prefill_tokens_are_bit_identical_to_dense(essay_ids, dense_server, model_dir, shipped_gate):
    """With SGLang's own CPU prefill (SAS_CPU_EXTEND=torch_native) a covering budget runs the very ops of the
    dense server, prefill and decode: every token and logprob equal, not just close. Both caches flushed
    first: SGLang's CPU prefill after a radix hit is not bit-identical to a fresh one (ops/extend is)."""
    args = ["--sas-gate", shipped_gate, "--sas-budget", "8192", *DENSE_ARGS[2:]]
    with Server(model_dir, backend="sas", extra_args=args, env={"SAS_CPU_EXTEND": "torch_native"}) as server:
        for length in PROMPT_LENGTHS:
            prompt = _prompt(essay_ids, length)
            flush_cache(dense_server.url)
            flush_cache(server.url)
            dense = generate(dense_server.url, prompt, NEW_TOKENS)
            sas = generate(server.url, prompt, NEW_TOKENS)
            assert_same_decodes(dense, sas, EXACT, f"sas with SGLang's prefill vs dense, {length}-token prompt",
                                n=NEW_TOKENS)
        assert "sas: CPU extend attention by torch_native" in server.log_text()


def test_sas_info_reports_config_and_gate(sas_full_server, shipped_gate):
    """The shipped trained gate loads in a real server, which reports its identity and training record."""
    import hashlib

    info = requests.get(f"{sas_full_server.url}/sas/info", timeout=30).json()
    assert info["active"] is True
    assert info["config"]["budget"] == 8192 and info["config"]["block_size"] == 64
    assert info["config"]["top_k"] == 128 and info["config"]["selector"] == "gate"
    assert info["gate"]["format"] == "canonical"
    assert info["gate"]["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert info["gate"]["sha256"] == hashlib.sha256((shipped_gate / "gate.safetensors").read_bytes()).hexdigest()
    assert info["gate"]["training"]["objective"] == "distill" and info["gate"]["training"]["budget"] == 2048
    # the launch set only the budget: the forced blocks come from the gate's serving record
    assert info["gate"]["serving"] == {"budget": 2048, "sink_blocks": 1, "local_blocks": 1}
    assert (info["config"]["sink_blocks"], info["config"]["local_blocks"]) == (1, 1)
    assert "sas: gate selector, 30 sparse layers" in sas_full_server.log_text()
    assert "summary pool" in sas_full_server.log_text()
    if not ON_GPU:  # the covering-budget comparisons above ran the sparse path, not the wrapped dense decode
        assert "sas: SAS_FORCE_SPARSE" in sas_full_server.log_text()
    if not ON_GPU:  # which prefill attention runs is logged
        assert "sas: CPU extend attention by sas (ops/extend)" in sas_full_server.log_text()


@pytest.mark.skipif(ON_GPU, reason="CPU: eager steps (the GPU's graph branches: tests/gpu/test_server_gpu.py)")
def test_dense_below_decodes_short_steps_densely(essay_ids, dense_server, model_dir, shipped_gate, tmp_path):
    """--sas-dense-below 400 with a 128-token budget: a 300-token prompt's steps (at most 330 tokens)
    decode densely, as the dense server does, and select nothing; a 450-token prompt's steps select
    (their selections are logged) and attend 2 blocks + the current one."""
    args = ["--sas-gate", shipped_gate, "--sas-budget", "128", "--sas-dense-below", "400", *DENSE_ARGS[2:]]
    debug = tmp_path / "selection"
    with Server(model_dir, backend="sas", extra_args=args, env={"SAS_DEBUG_DIR": str(debug)}) as server:
        short = _prompt(essay_ids, 300)
        dense = generate(dense_server.url, short, NEW_TOKENS)
        sas = generate(server.url, short, NEW_TOKENS)
        assert_same_decodes(dense, sas, KERNELS, "dense-below 400 vs dense, 300-token prompt", n=NEW_TOKENS)
        assert not list(debug.glob("*.jsonl")), "a step under the threshold selected blocks"
        complete(server.url, _prompt(essay_ids, 450), max_tokens=4)
        records = [line for f in debug.glob("*.jsonl") for line in f.read_text().splitlines()]
        assert len(records) == 4  # every step of the long prompt selected
        assert "requests hold at most 400 tokens in all attend densely" in server.log_text()
