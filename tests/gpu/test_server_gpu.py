"""Real SGLang servers on CUDA: captured-graph decode equals eager decode, full-budget sas equals
dense FlashInfer, and the memory sas allocates stays within what it told SGLang to reserve.

The servers run one after another (each takes most of the GPU), on the default model; or, where
the default model is not at hand (the offline GPU host of gpu_kit/run.py tier2), on the model in
$SAS_GPU_MODEL with the gate in $SAS_GPU_GATE and random prompts sharing a 640-token prefix (a
radix-cache hit for the later prompts); $SAS_GPU_SERVER_FLAGS adds flags to every server (e.g. a
small --chunked-prefill-size, so the prompts are prefilled in chunks).
"""

from __future__ import annotations

import functools
import os
import random
import re
import shlex

import pytest

from tests.server.compare import BF16_GPU, assert_same_decodes, generate
from tests.server.conftest import essay_ids, model_dir, shipped_gate, tokenizer  # noqa: F401 (fixtures)
from sas_backend.testing.server import Server

pytestmark = pytest.mark.gpu

PROMPT_LENGTHS = [700, 1500, 3000]  # all longer than the sparse budget: selection matters
NEW_TOKENS = 24
SPARSE = ["--sas-budget", "256"]
FULL = ["--sas-budget", "8192"]  # above the context: every block selected
NO_GRAPH = ["--disable-cuda-graph"]


GPU_MODEL, GPU_GATE = os.environ.get("SAS_GPU_MODEL"), os.environ.get("SAS_GPU_GATE")
SERVER_FLAGS = shlex.split(os.environ.get("SAS_GPU_SERVER_FLAGS", ""))


@pytest.fixture(scope="module")
def prompts(request):
    if GPU_MODEL:
        rng = random.Random(0)
        head = [rng.randrange(100, 32000) for _ in range(640)]
        return [head + [rng.randrange(100, 32000) for _ in range(n - len(head))] for n in PROMPT_LENGTHS]
    ids = request.getfixturevalue("essay_ids")
    return [ids[2000 + 5 * n : 2000 + 5 * n + n] for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def serve(request, prompts):
    """serve(backend, *args) -> (decodes, server log); each configuration runs once."""
    model = GPU_MODEL or request.getfixturevalue("model_dir")
    gate = GPU_GATE or request.getfixturevalue("shipped_gate")

    @functools.lru_cache(maxsize=None)
    def run(backend, *args):
        extra = ["--page-size", "64", *SERVER_FLAGS, *args]
        if backend == "sas":
            extra += ["--sas-gate", str(gate)]
        with Server(model, backend=backend, extra_args=extra) as s:
            return [generate(s.url, p, NEW_TOKENS) for p in prompts], s.log_text()

    return run


def _assert_same_greedy(ref, other, what):
    """Every prompt's decode: all NEW_TOKENS tokens, the same tokens with logprobs within compare.BF16_GPU, up to
    a reported near tie (at most BF16_GPU.max_near_ties over the prompts); see tests/server/compare.py."""
    assert_same_decodes(ref, other, BF16_GPU, what, n=NEW_TOKENS)


def test_sparse_graph_decode_equals_eager(serve):
    eager, _ = serve("sas", *SPARSE, *NO_GRAPH)
    graph, log = serve("sas", *SPARSE)
    assert "Capture" in log and "cuda graph" in log.lower()  # the graph server really captured
    _assert_same_greedy(eager, graph, "sas budget 256, graph vs eager")


def test_full_budget_equals_dense_flashinfer(serve):
    dense, _ = serve("flashinfer")
    full, _ = serve("sas", *FULL)
    _assert_same_greedy(dense, full, "sas full budget vs dense flashinfer")


def test_dense_below_picks_the_dense_or_the_sparse_graph_branch_per_step(serve):
    """--sas-dense-below 2000 with CUDA graphs: both attentions are captured (IF nodes) and each replay
    runs one. The two shorter prompts' steps (at most 1524 tokens) decode as dense FlashInfer does; the
    3000-token prompt's as the plain sparse graph server does."""
    dense, _ = serve("flashinfer")
    sparse, _ = serve("sas", *SPARSE)
    mixed, log = serve("sas", *SPARSE, "--sas-dense-below", "2000")
    assert "at most 2000 tokens in all attend densely" in log and "needs CUDA graph IF nodes" not in log
    assert "Capture" in log
    _assert_same_greedy(dense[:2], mixed[:2], "dense-below 2000, short prompts vs dense flashinfer")
    _assert_same_greedy(sparse[2:], mixed[2:], "dense-below 2000, long prompt vs sparse graph")


def _gb(pattern, log):
    found = re.findall(pattern, log)
    assert found, f"no match for {pattern!r} in the server log"
    return float(found[-1])


def test_capture_memory_within_the_reservation(serve):
    """sas tells SGLang to shrink the KV pool by R (log line); after graph capture it must have left
    at least as much free memory as the dense server (same model, args, GPU), within a margin for
    in-graph scratch: so everything sas added beside the pool fit inside R."""
    _, dense_log = serve("flashinfer")
    _, sas_log = serve("sas", *SPARSE)
    reserved_gb = _gb(r"sas: reserving ([\d.]+) MiB", sas_log) / 1024
    pool_end = r"Memory pool end\. avail mem=([\d.]+) GB"
    capture_end = r"Capture [^\n]*?end\.[^\n]*?avail mem=([\d.]+) GB"
    pool_gap = _gb(pool_end, sas_log) - _gb(pool_end, dense_log)
    capture_gap = _gb(capture_end, sas_log) - _gb(capture_end, dense_log)
    print(f"\nsas reserved {reserved_gb:.3f} GB; free after the KV pool: +{pool_gap:.2f} GB vs dense; "
          f"after capture: {capture_gap:+.2f} GB vs dense")
    assert reserved_gb > 0
    assert abs(pool_gap - reserved_gb) <= 0.05 + 0.02 * reserved_gb  # the pool shrank by R
    assert capture_gap >= -0.1  # sas used no more than R beside the pool (0.1 GB: in-graph scratch)


def test_standalone_speculation_with_sparse_verify_equals_sas_without(serve, request, prompts):
    """Speculative decoding on CUDA (issue 49): STANDALONE with the target model as its own draft (dense
    FlashInfer for the draft, which sas sets), chain drafts of 4, CUDA graphs on (SGLang then captures the verify
    step). Every verify row decodes as the sas decode step at its position: the greedy tokens are those of the
    same sas server without speculation, within compare.BF16_GPU; and speculation happened (verify steps, drafts)."""
    import requests

    model = GPU_MODEL or request.getfixturevalue("model_dir")
    gate = GPU_GATE or request.getfixturevalue("shipped_gate")
    plain, _ = serve("sas", *SPARSE)
    spec_args = ["--page-size", "64", *SERVER_FLAGS, *SPARSE, "--sas-gate", str(gate),
                 "--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", str(model),
                 "--speculative-eagle-topk", "1", "--speculative-num-steps", "3", "--speculative-num-draft-tokens", "4"]
    with Server(model, backend="sas", extra_args=spec_args) as s:
        spec = [generate(s.url, p, NEW_TOKENS) for p in prompts]
        body = {"input_ids": prompts[-1], "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0.0,
                                                               "ignore_eos": True}}
        meta = requests.post(f"{s.url}/generate", json=body, timeout=600).json()["meta_info"]
        log = s.log_text()
    assert "Capture" in log and "Overriding draft attention backend to flashinfer" in log  # SGLang, draft runner
    print(f"\nSTANDALONE on sas: accept length {meta.get('spec_accept_length')}, verify steps "
          f"{meta.get('spec_verify_ct')}, drafts {meta.get('spec_num_correct_drafts')}/"
          f"{meta.get('spec_num_proposed_drafts')}")
    _assert_same_greedy(plain, spec, "sas + STANDALONE (graphs) vs sas")
    # The draft is the target's weights attending densely, the target sparse: drafts are accepted where the two
    # agree, so how many is a measurement (printed), not a bound.
    assert meta.get("spec_verify_ct", 0) > 0 and meta.get("spec_num_proposed_drafts", 0) > 0, meta
