"""Real SGLang servers on CUDA: captured-graph decode equals eager decode, full-budget sas equals
dense FlashInfer, and the memory sas allocates stays within what it told SGLang to reserve.

The servers run one after another (each takes most of the GPU), on the default model.
"""

from __future__ import annotations

import functools
import re

import pytest

from tests.server.conftest import essay_ids, model_dir, shipped_gate, tokenizer  # noqa: F401 (fixtures)
from sas_backend.server_harness import Server, complete

pytestmark = pytest.mark.gpu

PROMPT_LENGTHS = [700, 1500, 3000]  # all longer than the sparse budget: selection matters
NEW_TOKENS = 24
SPARSE = ["--sas-budget", "256"]
FULL = ["--sas-budget", "8192"]  # above the context: every block selected
NO_GRAPH = ["--disable-cuda-graph"]


@pytest.fixture(scope="module")
def prompts(essay_ids):  # noqa: F811
    return [essay_ids[2000 + 5 * n : 2000 + 5 * n + n] for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def serve(model_dir, shipped_gate, prompts):  # noqa: F811
    """serve(backend, *args) -> (completions, server log); each configuration runs once."""

    @functools.lru_cache(maxsize=None)
    def run(backend, *args):
        extra = ["--page-size", "64", *args]
        if backend == "sas":
            extra += ["--sas-gate", str(shipped_gate)]
        with Server(model_dir, backend=backend, extra_args=extra) as s:
            outs = [
                complete(s.url, p, max_tokens=NEW_TOKENS, logprobs=2, return_token_ids=True)["choices"][0]
                for p in prompts
            ]
            return outs, s.log_text()

    return run


def _assert_same_greedy(ref, other, what):
    """Identical greedy tokens, up to the first near-tie of the reference (different kernels)."""
    for n, (a, b) in enumerate(zip(ref, other)):
        for i, (x, y) in enumerate(zip(a["token_ids"], b["token_ids"])):
            if x != y:
                top2 = sorted(a["logprobs"]["top_logprobs"][i].values())[-2:]
                assert top2[1] - top2[0] < 0.05, f"{what}, prompt {n}: token {i} differs, margin {top2}"
                break
        assert len(b["token_ids"]) == NEW_TOKENS


def test_sparse_graph_decode_equals_eager(serve):
    eager, _ = serve("sas", *SPARSE, *NO_GRAPH)
    graph, log = serve("sas", *SPARSE)
    assert "Capture" in log and "cuda graph" in log.lower()  # the graph server really captured
    _assert_same_greedy(eager, graph, "sas budget 256, graph vs eager")


def test_full_budget_equals_dense_flashinfer(serve):
    dense, _ = serve("flashinfer")
    full, _ = serve("sas", *FULL)
    _assert_same_greedy(dense, full, "sas full budget vs dense flashinfer")


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
