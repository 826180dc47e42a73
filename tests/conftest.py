"""Suite-wide: GPU tests (marker `gpu`) are skipped, with the reason, where CUDA is unavailable; under
pytest-xdist (tests/run.sh: `-n 2 --dist loadgroup`) tests are grouped so no fixture is built twice."""

from __future__ import annotations

import os

import pytest
import torch

# Without a GPU, Triton kernels run in the interpreter; Triton reads this when a kernel module is
# first imported, so it is set here, before any test module imports one.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def share_cores_between_workers() -> None:
    """Under pytest-xdist, pin this worker, and so every process it starts (servers, compilers), to its own
    share of the cores. Unpinned, two workers on 2 cores ran 4+ busy threads (each server's OpenMP pool, the
    sm_90 compile's processes) and the suite went slower than serially (the compile fixture over 13 min
    instead of 3.5); pinned, each worker's work runs as if alone on a smaller machine. With more workers than
    cores (SAS_TEST_WORKERS=3 on 2 cores) each worker gets one core, shared round-robin, and one OpenMP thread."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", 1))
    cores = sorted(os.sched_getaffinity(0))
    if not worker or count < 2:
        return
    index = int(worker.removeprefix("gw"))
    mine = cores[index % count::count] if len(cores) >= count else [cores[index % len(cores)]]
    os.sched_setaffinity(0, mine)
    os.environ["OMP_NUM_THREADS"] = str(len(mine))  # children size their OpenMP pools to the share
    torch.set_num_threads(len(mine))


share_cores_between_workers()

# The suite's servers decode sparsely at any context unless a test says otherwise: they check the sparse path
# itself, often on prompts shorter than the CPU default of --sas-dense-below (budget + 3072 tokens), which
# tests/server/test_cpu_dense_below.py checks with this pin removed.
from sas_backend.testing import server as _server  # noqa: E402

_server.PINNED_ENV["SAS_DENSE_BELOW"] = "0"


# The package-scoped servers of tests/server/conftest.py: every module that uses one runs in one xdist
# worker, so each server starts once (as in a serial run).
SHARED_SERVERS = {"dense_server", "sas_full_server", "sas_sparse_server"}
SHARED_SERVERS_GROUP = "shared-servers"
# Scheduling hint, heaviest first (minutes each on a 2-core CI machine), so that the other worker is not
# left with a long module at the end: longest-processing-time-first. Any module not named comes after.
HEAVY_MODULES = (
    "tests/test_triton_sm90_compile.py",
    "tests/server/test_soak.py",
    "tests/test_gate_generalization_script.py",
    "tests/server/test_prompt_anchors.py",
    "tests/test_gpu_kit.py",
)


@pytest.fixture(autouse=True)
def _grad_mode_restored():
    """Every test starts and ends with the autograd mode it found: a test that runs a benchmark's main() in-process
    (gpu_kit/bench_decode_step.main turns autograd off, as a script may) must not take it from the tests an xdist
    worker runs after it (2026-12-05: 29 training tests failed that way, 'does not require grad')."""
    mode = torch.is_grad_enabled()
    yield
    torch.set_grad_enabled(mode)


def _module(item) -> str:
    return item.nodeid.split("::", 1)[0]


def xdist_group(item):
    """The xdist_group `group_for_xdist` gave the item (None outside pytest-xdist)."""
    mark = item.get_closest_marker("xdist_group")
    return mark.args[0] if mark and mark.args else None


def group_for_xdist(items) -> None:
    """Mark each test with its xdist_group, in place, and order the items by unit, heaviest first.

    A unit is a whole module (its module-scoped fixtures are built once), except that all modules using a
    shared server form one unit, first in the queue. xdist's loadgroup scheduler hands units out in
    this order, so the shared-server unit goes to one worker and the rest fill the others.
    """
    shared = {_module(i) for i in items if SHARED_SERVERS & set(getattr(i, "fixturenames", ()))}

    def unit(item) -> str:
        return SHARED_SERVERS_GROUP if _module(item) in shared else _module(item)

    def rank(item) -> int:
        if unit(item) == SHARED_SERVERS_GROUP:
            return 0
        m = _module(item)
        return 1 + (HEAVY_MODULES.index(m) if m in HEAVY_MODULES else len(HEAVY_MODULES))

    for item in items:
        item.add_marker(pytest.mark.xdist_group(unit(item)))
    items.sort(key=rank)  # stable: collection order within a rank


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        group_for_xdist(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (FlashInfer / compiled Triton / CUDA graphs)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(optionalhook=True)  # an xdist hook: pytest without xdist must not reject it
def pytest_xdist_node_collection_finished(node, ids):
    """In the xdist controller, for each worker's collection: under `--dist loadgroup`, check that xdist took
    the groups (it ends a grouped test's node id with `@group`). pytest 9.2 broke that silently
    (pytest-xdist#1386), and every worker would then start its own copy of each shared server."""
    if node.config.getvalue("dist") == "loadgroup" and ids and not any("@" in i for i in ids):
        pytest.exit(f"pytest-xdist is not grouping tests on pytest {pytest.__version__} (pytest-xdist#1386): "
                    "install pytest<9.2 (pyproject's test extra pins it) or run serially "
                    "(SAS_TEST_WORKERS=0 bash tests/run.sh)", returncode=4)
