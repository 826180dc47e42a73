"""With a budget >= the context, sas decodes exactly like SGLang's dense torch-native backend; and limits
behave with `sas` exactly as with the dense backend, side by side.

The limits pair (`limit_servers`, until 2026-12-02 tests/server/test_limits.py): both servers with
`--context-length 1024 --max-running-requests 2`, same model and page size; `sas` with the shipped gate at a
covering budget (8192) and SGLang's own CPU prefill (SAS_CPU_EXTEND=torch_native), so on CPU it runs the dense
server's very ops and the pair also serves the bit-identical test (one server start fewer):
- a prompt over the context limit: the same 400 and message;
- a prompt that fits but leaves fewer tokens than `max_tokens` asks: the same answer;
- more concurrent requests than `--max-running-requests`: all served, never more than 2 running
  (the scheduler's own log), the same tokens.
"""

from __future__ import annotations

import concurrent.futures
import re

import pytest
import requests

from sas_backend.testing.server import ON_GPU, Server
from sas_backend.soak.run import flush_cache
from tests.server.compare import EXACT, KERNELS, assert_same_decodes, generate
from tests.server.conftest import DENSE_ARGS
from tests.server.memory_check import assert_held_as_reserved

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


CONTEXT = 1024
RUNNING = 2
# float32 on CPU: batched bf16 runs of two backends can part at a near-tie; fp32 ones do not.
LIMIT_ARGS = ["--context-length", CONTEXT, "--max-running-requests", RUNNING,
              "--dtype", "bfloat16" if ON_GPU else "float32"]
# The bit-identical test's prompts: PROMPT_LENGTHS within the limit pair's context (1500 -> 900, 14 blocks).
LIMITED_LENGTHS = [min(n, CONTEXT - NEW_TOKENS - 94) for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def limit_servers(model_dir, shipped_gate):
    """{"dense": SGLang's dense backend, "sas": sas at a covering budget (on CPU with SGLang's own prefill)},
    both at LIMIT_ARGS."""
    dense_backend = "flashinfer" if ON_GPU else "torch_native"
    sas_args = ["--sas-gate", shipped_gate, "--sas-budget", "8192", *DENSE_ARGS[2:], *LIMIT_ARGS]
    sas_env = {} if ON_GPU else {"SAS_CPU_EXTEND": "torch_native"}
    with Server(model_dir, backend=dense_backend, extra_args=DENSE_ARGS + LIMIT_ARGS) as dense:
        with Server(model_dir, backend="sas", extra_args=sas_args, env=sas_env) as sas:
            yield {"dense": dense, "sas": sas}


@pytest.mark.skipif(ON_GPU, reason="CPU: the same torch ops as the dense server, so bit-identical")
def test_with_sglang_prefill_tokens_are_bit_identical_to_dense(essay_ids, limit_servers):
    """With SGLang's own CPU prefill (SAS_CPU_EXTEND=torch_native) a covering budget runs the very ops of the
    dense server, prefill and decode: every token and logprob equal, not just close. Both caches flushed
    first: SGLang's CPU prefill after a radix hit is not bit-identical to a fresh one (ops/extend is)."""
    dense_server, server = limit_servers["dense"], limit_servers["sas"]
    for length in LIMITED_LENGTHS:
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
    # the shipped gate's geometry (SmolLM2, the covering budget) holds what its launch reserved
    assert assert_held_as_reserved(sas_full_server.url, exact=not ON_GPU)["held"]["gate weights"] > 0
    assert (info["config"]["sink_blocks"], info["config"]["local_blocks"]) == (1, 1)
    assert "sas: gate selector, 30 sparse layers" in sas_full_server.log_text()
    assert "summary pool" in sas_full_server.log_text()
    if not ON_GPU:  # the covering-budget comparisons above ran the sparse path, not the wrapped dense decode
        assert "sas: SAS_FORCE_SPARSE" in sas_full_server.log_text()
    if not ON_GPU:  # which prefill attention runs is logged
        assert "sas: CPU extend attention by sas (ops/extend)" in sas_full_server.log_text()


# --sas-dense-below: tests/server/test_training_free_selectors.py (its sink-local server runs it).


def _post(server, prompt, max_tokens):
    body = {"model": "default", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
    return requests.post(f"{server.url}/v1/completions", json=body, timeout=600)


def _answer(r):
    """What a client sees, without the parts that differ per request (ids, timestamps)."""
    if r.status_code != 200:
        return r.status_code, re.sub(r"[0-9a-f]{32}", "<id>", r.text)
    c = r.json()["choices"][0]
    return r.status_code, c["text"], c["finish_reason"], r.json()["usage"]["completion_tokens"]


def test_prompt_over_the_context_limit(essay_ids, limit_servers):
    prompt = essay_ids[1000:1000 + CONTEXT + 50]
    answers = {name: _answer(_post(s, prompt, 8)) for name, s in limit_servers.items()}
    assert answers["sas"][0] == 400, answers["sas"]
    assert answers["sas"] == answers["dense"]


def test_prompt_plus_max_tokens_over_the_limit(essay_ids, limit_servers):
    prompt = essay_ids[3000:3000 + CONTEXT - 20]  # fits; 100 new tokens do not
    answers = {name: _answer(_post(s, prompt, 100)) for name, s in limit_servers.items()}
    assert answers["sas"] == answers["dense"], answers


def test_more_requests_than_max_running(essay_ids, limit_servers):
    prompts = [essay_ids[10000 + 700 * i:10000 + 700 * i + 300] for i in range(5)]
    answers = {}
    for name, s in limit_servers.items():
        offset = len(s.log_text())
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            answers[name] = [_answer(r) for r in pool.map(lambda p: _post(s, p, 24), prompts)]
        log = s.log_text()[offset:]
        running = [int(m) for m in re.findall(r"#running-req: (\d+)", log)]
        assert running and max(running) <= RUNNING, (name, running)
        assert max(int(m) for m in re.findall(r"#queue-req: (\d+)", log)) >= 1, name  # some had to wait
        assert all(a[0] == 200 and a[3] == 24 for a in answers[name]), answers[name]
    if ON_GPU:  # different CUDA kernels: the same outcome, texts may part at a near-tie
        assert [a[0::2] for a in answers["sas"]] == [a[0::2] for a in answers["dense"]]
    else:
        assert answers["sas"] == answers["dense"]
