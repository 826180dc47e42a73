"""SGLang's own benchmark scripts run with `--attention-backend sas` through `python -m sas_backend.sglang_bench`.

Run directly, SGLang's scripts refuse `sas` (they parse arguments without loading plugins); the
wrapper loads the plugins and hands over to the unchanged script. Each tool runs here on the CPU
engine at a tiny size (batch 1, 128 input tokens, 4 output tokens) on the default model with the
shipped gate, and must exit 0 with its usual output, built by the sas backend (its startup lines
are in the output). `serving` runs against the package's sas server.

Prompts: SGLang's `random` dataset cuts token ids out of a ShareGPT-format JSON file, downloading
ShareGPT when none is given (`offline_throughput` does so even for its warm-up), so the tests
write a small one from the essays.

`one_batch_server` runs against the package's sas server (`--base-url`, so no second server
start); with SAS_BENCH_LAUNCH=1 it also launches its own, with `--skip-server-warmup`: the script
treats a server as ready once /v1/models answers, while the server's own warm-up request may still
be decoding; its first /flush_cache then gets 400 ("pending requests") three times and the script
dies (seen on the busy 2-core CI machine, SGLang 0.5.21).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import requests

from sas_backend import sglang_bench as bench
from sas_backend.testing.server import ON_GPU, cpu_env, free_port

from .conftest import ESSAYS

pytestmark = pytest.mark.skipif(ON_GPU, reason="CPU-engine arguments; on a GPU host run the tools by hand")

SAS_STARTED = "sas: gate selector"  # logged by the backend when a model runner builds it
TINY = ["--batch-size", "1", "--input-len", "128", "--output-len", "4"]


def run_tool(args, cwd, timeout=420) -> str:
    """`python -m sas_backend.sglang_bench ARGS` in its own session; returns stdout+stderr, asserting exit 0."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "sas_backend.sglang_bench", *map(str, args)], cwd=cwd, env=cpu_env(),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"{args[0]} did not finish within {timeout}s; output tail:\n{out[-6000:]}")
    finally:
        try:  # a server or rank the tool started and left behind
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert proc.returncode == 0, f"{args[0]} exited {proc.returncode}; output tail:\n{out[-6000:]}"
    return out


def assert_serves_sas(url) -> None:
    info = requests.get(f"{url}/server_info", timeout=30).json()
    assert info.get("attention_backend") == "sas", info.get("attention_backend")


def last_json_line(path) -> dict:
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    assert lines, f"{path} is empty"
    return json.loads(lines[-1])


@pytest.fixture(scope="module")
def sharegpt_json(tmp_path_factory):
    """Eight essays as one-turn ShareGPT conversations (what `--dataset-name random` samples from)."""
    paths = sorted(ESSAYS.glob("*.txt"))[:8]
    if not paths:
        pytest.fail("essays missing: run `python serve/prepare_text.py`")
    rows = [{"conversations": [{"from": "human", "value": p.read_text()[:4000]},
                               {"from": "gpt", "value": "Noted."}]} for p in paths]
    out = tmp_path_factory.mktemp("bench-data") / "essays_sharegpt.json"
    out.write_text(json.dumps(rows))
    return out


@pytest.fixture(scope="module")
def sas_args(model_dir, shipped_gate):
    """Server arguments as the harness's CPU servers use them, plus the sas backend."""
    return ["--model-path", model_dir, "--attention-backend", "sas", "--sas-gate", shipped_gate,
            "--device", "cpu", "--max-total-tokens", "16384", "--random-seed", "0"]


# ------------------------------------------------------------------------------ the wrapper
def test_help_lists_each_tool_and_its_module(capsys):
    assert bench.main(["--help"]) == 0
    out = capsys.readouterr().out
    for tool in bench.TOOLS:
        module = bench.resolve_module(tool)
        assert module is not None, f"{tool}: none of {bench.TOOLS[tool][1]} in this SGLang"
        assert f"{tool}" in out and f"python -m {module}" in out
    assert bench.canonical_tool("sglang.bench_one_batch_server") == "one_batch_server"
    assert bench.canonical_tool("bench-offline-throughput") == "offline_throughput"


def test_unknown_tool_is_a_clear_error(capsys):
    assert bench.main(["one_batch_servr", "--model-path", "x"]) == 2
    err = capsys.readouterr().err
    assert "unknown tool 'one_batch_servr'" in err and "one_batch_server" in err


def test_spawned_children_load_the_plugin(tmp_path):
    """A process the wrapper starts with multiprocessing's spawn method (one_batch's ranks with
    --tp-size > 1, one_batch_server's server, the engine's schedulers) registers sas before it runs
    its work; without the hook it does not (one_batch --tp-size 3 then fails in every rank with
    "ValueError: Invalid attention backend: sas")."""
    code = (
        "import json, multiprocessing as mp\n"
        "from sas_backend import sglang_bench as bench\n"
        "ctx = mp.get_context('spawn')\n"
        "without = ctx.Pool(1)\n"  # started now, before the hook; both children start side by side
        "bench.install_spawn_hook()\n"
        "with_hook = ctx.Pool(1)\n"
        "for pool in (without, with_hook): print(json.dumps(pool.apply(bench.plugin_state))); pool.terminate()\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=cpu_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    without, with_hook = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert not without["choice"] and not without["factory"], without
    assert with_hook["choice"] and with_hook["factory"], with_hook
    assert with_hook["process"].startswith("SpawnPoolWorker"), with_hook  # not MainProcess: no /sas/info


# --------------------------------------------------------------------------- the tools on CPU
def test_one_batch(tmp_path, sas_args):
    result = tmp_path / "one_batch.jsonl"
    out = run_tool(["one_batch", *sas_args, *TINY, "--result-filename", result], cwd=tmp_path)
    assert SAS_STARTED in out
    assert "Decode.  median latency:" in out and "Benchmark ..." in out
    rec = last_json_line(result)
    assert (rec["batch_size"], rec["input_len"], rec["output_len"]) == (1, 128, 4)
    assert rec["median_decode_latency"] > 0 and rec["prefill_latency"] > 0


@pytest.mark.parametrize("launch", [
    False,
    pytest.param(True, marks=pytest.mark.skipif(
        os.environ.get("SAS_BENCH_LAUNCH") != "1",
        reason="the script's own server start costs about a minute on CPU; SAS_BENCH_LAUNCH=1 runs it")),
], ids=["base-url", "launch"])
def test_one_batch_server(tmp_path, sas_args, sharegpt_json, request, launch):
    """By default against the package's sas server (--base-url: shared with the serving test and
    the other server tests); with SAS_BENCH_LAUNCH=1 the script also launches its own sas server
    (a spawned process) as it does without --base-url."""
    result = tmp_path / "one_batch_server.jsonl"
    if launch:
        target = ["--port", free_port(), "--sleep-on-idle", "--skip-server-warmup"]
    else:
        url = request.getfixturevalue("sas_full_server").url
        assert_serves_sas(url)
        target = ["--base-url", url]
    out = run_tool(["one_batch_server", *sas_args, *TINY, *target, "--skip-warmup",
                    "--dataset-name", "random", "--dataset-path", sharegpt_json,
                    "--result-filename", result, "--show-report"], cwd=tmp_path)
    if launch:
        assert SAS_STARTED in out
        assert "'attention_backend': 'sas'" in out  # the launched server's arguments
    assert "latency (s)" in out and "output throughput (tok/s)" in out  # --show-report's table
    rec = last_json_line(result)
    assert (rec["batch_size"], rec["input_len"], rec["output_len"]) == (1, 128, 4)
    assert rec["total_output_tokens"] == 4 and rec["latency"] > 0


def test_offline_throughput(tmp_path, sas_args, sharegpt_json):
    result = tmp_path / "offline_throughput.jsonl"
    out = run_tool(["offline_throughput", *sas_args, "--sleep-on-idle", "--dataset-name", "random",
                    "--dataset-path", sharegpt_json, "--random-input-len", "128", "--random-output-len", "4",
                    "--random-range-ratio", "1", "--num-prompts", "2", "--skip-warmup",
                    "--result-filename", result], cwd=tmp_path)
    assert SAS_STARTED in out
    assert "Offline Throughput Benchmark Result" in out
    rec = last_json_line(result)
    assert rec["successful_requests"] == 2 and rec["total_output_tokens"] == 8, rec


def test_serving_against_a_sas_server(tmp_path, sas_full_server, model_dir, sharegpt_json):
    """bench_serving only talks HTTP; through the same entry against the package's sas server."""
    assert_serves_sas(sas_full_server.url)
    result = tmp_path / "serving.jsonl"
    num = 4
    out = run_tool(["serving", "--backend", "sglang", "--base-url", sas_full_server.url,
                    "--tokenizer", model_dir, "--dataset-name", "random", "--dataset-path", sharegpt_json,
                    "--random-input-len", "128", "--random-output-len", "4", "--random-range-ratio", "1",
                    "--num-prompts", num, "--max-concurrency", "2", "--disable-tqdm",
                    "--output-file", result], cwd=tmp_path)
    assert "Serving Benchmark Result" in out
    rec = last_json_line(result)
    assert rec["completed"] == num, rec.get("errors")
    assert not any(rec.get("errors") or []), rec["errors"]
    assert rec["total_output_tokens"] == num * 4
