"""The CPU default of `--sas-dense-below` (issue 64 item 7): a server launched without it decodes densely up to
budget + CPU_DENSE_MARGIN tokens, where a sparse step is slower than dense on a CPU at batch 1
(bench/results/2026-12-05-cpu-crossover), and selects above. The rest of the suite pins it to 0
(tests/conftest.py); this module removes the pin, as a user's launch has none."""

from __future__ import annotations

import pytest

import requests

from sas_backend.config import CPU_DENSE_MARGIN
from sas_backend.testing.server import ON_GPU, Server
from tests.server.compare import KERNELS, assert_same_decodes, generate

pytestmark = pytest.mark.skipif(ON_GPU, reason="the CPU default (CUDA reads the settings table)")

BUDGET = 256  # K = 4 blocks: a 700-token prompt has 10 complete blocks, so it would select without the default
DEFAULT = BUDGET + CPU_DENSE_MARGIN  # 3328 tokens
SHORT, LONG, NEW = 700, 3500, 6


def _steps(url) -> dict:
    pool = requests.get(f"{url}/sas/info", timeout=60).json()["pool"]
    return pool[0]


def test_cpu_default_decodes_short_contexts_densely_and_long_ones_sparsely(model_dir, essay_ids, dense_server):
    args = ["--sas-selector", "sink-local", "--sas-budget", str(BUDGET), "--dtype", "float32"]
    short, long = essay_ids[4000 : 4000 + SHORT], essay_ids[6000 : 6000 + LONG]
    with Server(model_dir, backend="sas", extra_args=args, env={"SAS_DENSE_BELOW": None}) as server:
        before = _steps(server.url)
        assert before["dense_below"] == DEFAULT, before
        got = generate(server.url, short, NEW)
        after_short = _steps(server.url)["decode_steps"]
        generate(server.url, long, NEW)
        after_long = _steps(server.url)["decode_steps"]
        log = server.log_text()
    assert f"requests hold at most {DEFAULT} tokens in all attend densely" in log
    # The short prompt (at most 706 tokens): every decode step dense, the tokens the dense server writes.
    steps = after_short["dense"] - before["decode_steps"]["dense"]  # SGLang's decode steps for NEW tokens
    assert after_short["sparse"] == before["decode_steps"]["sparse"] and steps >= NEW - 1, (before, after_short)
    assert_same_decodes(generate(dense_server.url, short, NEW), got, KERNELS, "CPU dense-below default, short")
    # The long prompt (3500 tokens > 3328): every decode step selects.
    assert after_long["sparse"] - after_short["sparse"] == steps and after_long["dense"] == after_short["dense"]
