"""Faults a server meets in production: it keeps serving and loses no KV page or summary row.

One `sas` server (the shipped gate, copied, at a 256-token budget; prefill chunks of 256 tokens):
- a client disconnects while its long prompt is being prefilled chunk by chunk;
- a request is aborted through SGLang's abort API after its prefill and before its first decode
  step (it waits behind another request's chunked prefill, which the scheduler runs first); the request
  batched with it decodes as it does alone;
- the gate file is replaced on disk while serving: the loaded gate goes on being used, /sas/info
  still names it, and nothing is re-read (a server on the new file's gate gives the same prefill token
  and decode steps that differ by far more than the tolerance).
After each: a probe request decodes as before (every token and logprob, bit for bit), and once idle every
page is free or cached and every summary row reclaimable (`/sas/info` pool state), with SGLang's idle leak
check silent. Comparisons: tests/server/compare.py.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import threading
import time

import pytest
import requests

from sas_backend.testing.server import ON_GPU, Server
from sas_backend.soak.run import flush_cache, pool_state, wait_idle
from tests.server.compare import EXACT, KERNELS, assert_same_decodes, decode_from_response, generate

BUDGET = 256
CHUNK = 256
LONG_PROMPT = 6000  # 24 prefill chunks: seconds of chunked prefill on a CPU
# A's prompt in the abort test: 12 chunks still to run when B's abort is in (it is sent at once), with
# half the prefill time of LONG_PROMPT (25 s of CI)
ABORT_LONG_PROMPT = 3000
SPARSE_PROMPT = 1500
NEW_TOKENS = 12
# The new gate's decode of the probe differs from the loaded gate's by more than this somewhere before their
# tokens part (a replacement that changed nothing would make the replacement test vacuous): the oracle's bound
# between sparse and dense. Measured 2026-12-01 (CPU, fp32): the first decode step moved 0.129, the second chose
# another token; the prefill's token equal, its logprob bit for bit.
FAULT_MOVE = 2e-2


@pytest.fixture(scope="module")
def gate_copy(shipped_gate, tmp_path_factory):
    d = tmp_path_factory.mktemp("gate-replaced") / "gate"
    shutil.copytree(shipped_gate, d)
    return d


@pytest.fixture(scope="module")
def fault_server(model_dir, gate_copy):
    args = ["--sas-gate", gate_copy, "--sas-budget", BUDGET, "--chunked-prefill-size", CHUNK]
    if ON_GPU:
        args.append("--disable-cuda-graph")  # fewer minutes; the graph path is covered elsewhere
    with Server(model_dir, backend="sas", extra_args=args) as s:
        yield s


@pytest.fixture(scope="module")
def probe(essay_ids, fault_server):
    """A sparse request's greedy decode (tokens and logprobs) before any fault."""
    prompt = essay_ids[20000:20000 + SPARSE_PROMPT]
    return prompt, generate(fault_server.url, prompt, NEW_TOKENS)


def _log_from(server, offset: int) -> str:
    return server.log_text()[offset:]


def _wait_for(server, offset: int, pattern: str, timeout: float = 300.0) -> re.Match:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = re.search(pattern, _log_from(server, offset))
        if m:
            return m
        time.sleep(0.02)
    raise AssertionError(f"no {pattern!r} in the server log within {timeout}s:\n{server.log_tail()}")


def _assert_whole(server, probe, fault: str):
    """The probe decodes as before, bit for bit (the same server, the same ops: a fault must change nothing of a
    later request); idle, nothing held, no leak warning; after a flush every page is free."""
    prompt, ref = probe
    assert_same_decodes(ref, generate(server.url, prompt, NEW_TOKENS), EXACT, f"probe after {fault}", n=NEW_TOKENS)
    state = wait_idle(server.url, timeout=120)
    assert state["idle"] and state["kv_pages"]["in_use"] == 0, state
    assert state["summary_rows"]["held"] == 0 and state["summary_rows"]["one_per_page"], state
    assert state["leak_warnings"] == 0, state
    flush_cache(server.url)
    pages = pool_state(server.url)["kv_pages"]
    assert pages["free"] == pages["total"], pages
    assert "memory leak" not in server.log_text()
    assert server.alive()


def _chunk_lines(text: str) -> int:
    return len(re.findall(r"Prefill batch.*#new-token: (\d+)", text))


def test_client_disconnect_during_chunked_prefill(essay_ids, fault_server, probe):
    offset = len(fault_server.log_text())
    body = {"input_ids": essay_ids[30000:30000 + LONG_PROMPT], "stream": True,
            "sampling_params": {"max_new_tokens": 16, "temperature": 0.0}}
    r = requests.post(f"{fault_server.url}/generate", json=body, stream=True, timeout=600)
    assert r.status_code == 200
    _wait_for(fault_server, offset, r"Prefill batch.*#new-token: 256")  # the first chunk is running
    r.close()  # the client goes away mid-prefill
    # SGLang notices the closed connection within a few seconds and aborts the request in the scheduler.
    state = wait_idle(fault_server.url, timeout=300)
    chunks = _chunk_lines(_log_from(fault_server, offset))
    assert chunks < LONG_PROMPT // CHUNK, f"the prefill ran to its end ({chunks} chunks): no abort mid-prefill"
    assert state["kv_pages"]["in_use"] == 0, state
    _assert_whole(fault_server, probe, "a disconnect mid-prefill")


def test_abort_between_prefill_and_first_decode(essay_ids, fault_server, probe):
    """B (short) and A (long) arrive as one batch request: B is prefilled together with A's first
    chunk, and A's other chunks run before any decode step (the scheduler runs prefill first), so
    B waits there, prefilled, when its abort arrives. A, in the same batch, decodes as it does alone."""
    flush_cache(fault_server.url)
    offset = len(fault_server.log_text())
    result = {}
    body = {
        "input_ids": [essay_ids[50000:50100], essay_ids[60000:60000 + ABORT_LONG_PROMPT]],
        "rid": ["sas-abort-b", "sas-long-a"],
        "sampling_params": [{"max_new_tokens": 32, "temperature": 0.0, "ignore_eos": True},
                            {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}],
        "return_logprob": True, "top_logprobs_num": 2,
    }
    t = threading.Thread(target=lambda: result.update(
        out=requests.post(f"{fault_server.url}/generate", json=body, timeout=600).json()))
    t.start()
    _wait_for(fault_server, offset, r"Prefill batch, #new-seq: 2")  # B and A's first chunk, together
    aborted = requests.post(f"{fault_server.url}/abort_request", json={"rid": "sas-abort-b"}, timeout=60)
    assert aborted.status_code == 200
    aborted_at = len(fault_server.log_text())
    t.join(600)
    meta_b, meta_a = (r["meta_info"] for r in result["out"])
    assert meta_b["finish_reason"]["type"] == "abort", meta_b
    # A's prefill was still running when the abort was in: B's first decode step was still to come.
    assert _chunk_lines(fault_server.log_text()[aborted_at:]) >= 1
    # One token from the prefill, at most one from the decode step in which SGLang applies an abort
    # of a running request (it marks the request and finishes it when that step's result comes back).
    assert meta_b["completion_tokens"] <= 2, meta_b
    assert meta_a["completion_tokens"] == 4, meta_a
    # What must not change: A, batched with B and its abort, decodes as it does alone (its prompt now a radix
    # hit; the same kernels, but batched with B's prefill: fp32 rounding, so compare.KERNELS, not EXACT).
    alone = generate(fault_server.url, body["input_ids"][1], 4)
    assert_same_decodes(alone, decode_from_response(result["out"][1]), KERNELS, "A beside B's abort vs A alone", n=4)
    _assert_whole(fault_server, probe, "an abort before the first decode step")


def test_gate_file_replaced_while_serving(essay_ids, fault_server, probe, gate_copy, seed_gate, sas_sparse_server,
                                         tmp_path):
    original = hashlib.sha256((gate_copy / "gate.safetensors").read_bytes()).hexdigest()
    staged = tmp_path / "new.safetensors"
    shutil.copy(seed_gate / "gate.safetensors", staged)
    staged.replace(gate_copy / "gate.safetensors")  # atomic, as a deploy would
    replaced = hashlib.sha256((gate_copy / "gate.safetensors").read_bytes()).hexdigest()
    assert replaced != original

    info = requests.get(f"{fault_server.url}/sas/info", timeout=60).json()
    assert info["gate"]["sha256"] == original  # the gate as launched, not the file now on disk
    assert info["pool"][0]["gate_sha256"] == original  # and the one the scheduler loaded
    flush_cache(fault_server.url)  # the prefill recomputes every summary with the loaded gate
    prompt, ref = probe
    again = generate(fault_server.url, prompt, NEW_TOKENS)
    assert_same_decodes(ref, again, EXACT, "probe after the gate file was replaced (cache flushed)", n=NEW_TOKENS)
    _assert_whole(fault_server, probe, "the gate file's replacement")

    # The replacement would have mattered: a server started on the new file's gate decodes differently.
    # The suite's sparse server is one (the seeded gate at the same budget and forced blocks, the same dtype; it
    # saves a server start, a minute of CI); it differs from the fault server in its prefill chunks only.
    sparse_info = requests.get(f"{sas_sparse_server.url}/sas/info", timeout=60).json()
    assert sparse_info["gate"]["sha256"] == replaced
    for key in ("budget", "sink_blocks", "local_blocks", "block_size", "selector"):
        assert sparse_info["config"][key] == info["config"][key], (key, sparse_info["config"], info["config"])
    other = generate(sas_sparse_server.url, prompt, NEW_TOKENS)
    # What must not change with the gate: the prefill's token (the prefill is dense; the gate plays no part).
    assert_same_decodes(ref.head(1), other.head(1), KERNELS, "prefill token, loaded vs new gate", n=1)
    # What changes: the decode steps (sparse: the new gate selects other blocks). Up to their first differing
    # token (if any), some step's logprob moves by far more than the tolerance: FAULT_MOVE (measured: see there).
    steps = next((i for i in range(1, NEW_TOKENS) if other.token_ids[i] != ref.token_ids[i]), NEW_TOKENS)
    moved = max([abs(other.logprobs[i] - ref.logprobs[i]) for i in range(1, steps)], default=0.0)
    print(f"new gate vs loaded gate: decode steps equal in token 1..{steps - 1}, max |dlogprob| {moved:.3g}")
    assert steps < NEW_TOKENS or moved > max(FAULT_MOVE, KERNELS.logprob), (steps, moved)
