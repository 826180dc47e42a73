"""The GPU decode path on CPU inside a real server: `--sas-kernels triton` runs the fused front / select /
attend Triton kernels (in Triton's interpreter, TRITON_INTERPRET=1) instead of the torch path, and decodes
exactly as the torch path does: the same greedy tokens, logprobs within compare.FP32, at a budget below the context
(4 of ~15 blocks), with a block completed during the decode (the front kernel writes its summary; no compared
step ranks it: the local block is forced for 64 steps, and tests/test_decode_step_object.py compares the fused
step's summaries with the per-op step's). The reference is `sas_sparse_server` (same gate,
budget, forced blocks and fp32), whose decode the oracle test checks."""

from __future__ import annotations

import pytest

from sas_backend.testing.server import ON_GPU, Server
from tests.server.compare import FP32, assert_same_decodes, generate

PROMPT_LEN = 1020  # the decode step at seq_len 1024 completes block 15: a block step is among those compared
NEW_TOKENS = 5  # decode steps at seq_len 1021..1024


@pytest.fixture(scope="module")
def triton_server(model_dir, seed_gate):
    if ON_GPU:
        pytest.skip("on a GPU the fused kernels are the default path (tests/gpu)")
    args = ["--sas-gate", seed_gate, "--sas-budget", "256", "--sas-sink-blocks", "1", "--sas-local-blocks", "1",
            "--dtype", "float32", "--sas-kernels", "triton"]
    with Server(model_dir, backend="sas", extra_args=args) as s:
        yield s


def test_triton_kernels_decode_as_the_torch_path(essay_ids, triton_server, sas_sparse_server):
    log = triton_server.log_text()
    assert "decode step kernels triton, attention triton" in log, log[-3000:]
    prompt = essay_ids[9000: 9000 + PROMPT_LEN]
    got = generate(triton_server.url, prompt, NEW_TOKENS)
    want = generate(sas_sparse_server.url, prompt, NEW_TOKENS)
    assert_same_decodes(want, got, FP32, "triton kernels (interpreter) vs torch path", n=NEW_TOKENS)
