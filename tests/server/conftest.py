"""Fixtures for the end-to-end tests: the default model, a seeded gate, essay tokens, servers."""

from __future__ import annotations

import pathlib

import pytest

from sas_backend.corpus import default_essays_dir
from sas_backend.testing.server import DEFAULT_MODEL, ON_GPU, Server

ESSAYS = pathlib.Path(default_essays_dir())
DENSE_ARGS = ["--page-size", "64", "--enable-cache-report"]


# Server-vs-server comparisons: tests/server/compare.py (one helper, its tolerances stated there).


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/server/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.server)


@pytest.fixture(scope="session")
def model_dir() -> pathlib.Path:
    if not (DEFAULT_MODEL / "config.json").exists():
        pytest.fail(f"default model missing: run `python serve/prepare_model.py` (expected {DEFAULT_MODEL})")
    return DEFAULT_MODEL


@pytest.fixture(scope="session")
def seed_gate(model_dir, tmp_path_factory) -> pathlib.Path:
    """A seeded-init gate for the default model (same code path as a trained one)."""
    from sas_backend.gate.checkpoint import init_gate_checkpoint

    out = tmp_path_factory.mktemp("gates") / "smollm2-seed0"
    init_gate_checkpoint(out, model_dir=model_dir, seed=0)
    return out


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="session")
def essay_ids(tokenizer) -> list:
    """Token ids of the essays, concatenated (about 150K tokens of real English)."""
    paths = sorted(ESSAYS.glob("*.txt"))
    if not paths:
        pytest.fail("essays missing: run `python serve/prepare_text.py`")
    text = "\n\n".join(p.read_text() for p in paths)
    ids = tokenizer(text)["input_ids"]
    assert len(ids) > 120_000, len(ids)  # the tests slice up to ~95K
    return ids


# The servers are package-scoped: they stop when the last test of tests/server has run, not at the
# end of the session, so the tests after this package do not share the machine with them. Under pytest-xdist
# they stop earlier, once their worker has run the last test of the shared-servers group (below).
SHARED_RUNNING: list = []  # the shared servers started in this process


def _shared(server: Server) -> Server:
    SHARED_RUNNING.append(server)
    return server


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """Under pytest-xdist the shared-servers group runs first and whole on one worker (tests/conftest.py), which
    then runs other modules with servers of their own: the three idle shared servers (~9 GiB with their
    launchers) beside those and the other worker's got a tp3 server OOM-killed on the 24 GiB machine (2026-12-06).
    So they stop as soon as the worker's next test is not of the group; their fixtures' teardown is then a no-op."""
    from tests.conftest import SHARED_SERVERS_GROUP, xdist_group

    if nextitem is not None and xdist_group(item) == SHARED_SERVERS_GROUP != xdist_group(nextitem):
        for server in SHARED_RUNNING:
            server.stop()
        SHARED_RUNNING.clear()


@pytest.fixture(scope="package")
def dense_server(model_dir):
    """SGLang's own dense backend: torch-native on CPU (what sas wraps there), FlashInfer on GPU."""
    with Server(model_dir, backend="flashinfer" if ON_GPU else "torch_native", extra_args=DENSE_ARGS) as s:
        yield _shared(s)


@pytest.fixture(scope="session")
def shipped_gate() -> pathlib.Path:
    """The trained SAS gate the repository ships for the default model (serve/serve.sh's default)."""
    path = pathlib.Path(__file__).resolve().parents[2] / "gate_checkpoints" / "smollm2-135m-instruct-sas"
    assert (path / "gate.safetensors").is_file(), f"{path} is missing: the shipped gate is part of the repository"
    return path


@pytest.fixture(scope="package")
def sas_full_server(model_dir, shipped_gate):
    """sas with the shipped gate and a budget above the context length: every block is selected. On CPU with
    SAS_FORCE_SPARSE=1, so the covering-budget tests run the selection and the sparse attention (an eager CPU
    step would otherwise take the wrapped dense decode, which is exactly what selection would attend)."""
    args = ["--sas-gate", shipped_gate, "--sas-budget", "8192", "--enable-cache-report"]
    with Server(model_dir, backend="sas", extra_args=args, env={"SAS_FORCE_SPARSE": "1"}) as s:
        yield _shared(s)


@pytest.fixture(scope="session")
def sparse_debug_dir(tmp_path_factory) -> pathlib.Path:
    return tmp_path_factory.mktemp("sas-debug")


@pytest.fixture(scope="package")
def sas_sparse_server(model_dir, seed_gate, sparse_debug_dir):
    """sas at a 256-token budget (1 sink + 1 local + 2 gate-chosen blocks per kv head), fp32 (tight
    comparison with the oracle), selection log on. The seeded gate on purpose: its kv heads pick
    different blocks, which the test checks (the trained gate's layer-0 heads agree with each other).

    Started with `sglang serve` (the other servers use `python -m sglang.launch_server`), so both
    entry points load the plugin in every test run.
    """
    args = [
        "--sas-gate", seed_gate, "--sas-budget", "256", "--sas-sink-blocks", "1", "--sas-local-blocks", "1",
        # fp32 on CPU for a tight oracle comparison; FlashInfer decodes in half precision on GPU.
        "--dtype", "bfloat16" if ON_GPU else "float32", "--enable-cache-report",
    ]
    if ON_GPU:  # the selection log reads the host each step; sas_full_server covers CUDA graphs
        args.append("--disable-cuda-graph")
    env = {"SAS_DEBUG_DIR": str(sparse_debug_dir)}
    with Server(model_dir, backend="sas", extra_args=args, env=env, entry="serve") as s:
        yield _shared(s)
