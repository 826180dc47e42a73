"""The server harness every test and benchmark starts SGLang through."""

from __future__ import annotations

from sas_backend.testing.server import server_cmd


def test_every_server_sleeps_when_idle_once():
    """An idle scheduler without --sleep-on-idle busy-polls a core for the rest of the run: the
    harness adds the flag, and does not repeat it when the caller passed it."""
    cmd = server_cmd("m", "sas", 1234, ["--sas-budget", 512])
    assert cmd.count("--sleep-on-idle") == 1 and cmd[cmd.index("--sas-budget") + 1] == "512"
    assert server_cmd("m", "sas", 1234, ["--sleep-on-idle"]).count("--sleep-on-idle") == 1


def test_cpu_servers_outlast_long_context_forwards(monkeypatch):
    """SGLang's 300 s scheduler watchdog killed a CPU server mid-benchmark (a batch extending a cached
    32K prefix for 3 requests took longer): CPU servers get CPU_WATCHDOG_S unless the caller sets one;
    GPU servers keep SGLang's default."""
    from sas_backend.testing import server as server_harness

    monkeypatch.setattr(server_harness, "ON_GPU", False)
    cmd = server_cmd("m", "sas", 1234)
    assert cmd[cmd.index("--watchdog-timeout") + 1] == str(server_harness.CPU_WATCHDOG_S)
    assert server_harness.CPU_WATCHDOG_S >= 1800
    mine = server_cmd("m", "sas", 1234, ["--watchdog-timeout", "60"])
    assert mine.count("--watchdog-timeout") == 1 and mine[mine.index("--watchdog-timeout") + 1] == "60"
    monkeypatch.setattr(server_harness, "ON_GPU", True)
    assert "--watchdog-timeout" not in server_cmd("m", "sas", 1234)


def test_cpu_servers_run_fp32_unless_told(monkeypatch):
    """The models' configs say bf16, which an AVX2-only CPU multiplies ~100x slower than fp32 (the CI
    soak took 10 min instead of 2.5 on one): CPU servers get --dtype float32 unless the caller names a
    dtype; GPU servers keep the model's."""
    from sas_backend.testing import server as server_harness

    monkeypatch.setattr(server_harness, "ON_GPU", False)
    cmd = server_cmd("m", "sas", 1234)
    assert cmd[cmd.index("--dtype") + 1] == "float32"
    mine = server_cmd("m", "sas", 1234, ["--dtype", "bfloat16"])
    assert mine.count("--dtype") == 1 and mine[mine.index("--dtype") + 1] == "bfloat16"
    monkeypatch.setattr(server_harness, "ON_GPU", True)
    assert "--dtype" not in server_cmd("m", "sas", 1234)


def test_cpu_threads_bind_splits_the_allowed_cores_over_ranks(monkeypatch):
    """Runs of the affinity's cores per rank (tests/run.sh pins each xdist worker to its own cores),
    round-robin when there are fewer cores than ranks, comma lists where a run has a gap."""
    from sas_backend.testing import server as server_harness

    cases = [({0, 1}, 2, "0|1"), ({0, 1}, 3, "0|1|0"), ({0}, 3, "0|0|0"), (set(range(8)), 2, "0-3|4-7"),
             ({1, 3, 5, 7}, 2, "1,3|5,7"), ({4, 5, 6}, 1, "4-6")]
    for cores, ranks, expected in cases:
        monkeypatch.setattr(server_harness.os, "sched_getaffinity", lambda pid, c=cores: c)
        assert server_harness.cpu_threads_bind(ranks) == expected, (cores, ranks)


def test_free_ports_leave_room_for_the_ports_sglang_derives():
    """SGLang 0.5.15 refuses --port P when P + 10000 (its gRPC port) exceeds 65535: the first GPU run's
    servers failed so with ports from bind(0). free_port stays below that and skips a busy port."""
    import random
    import socket

    from sas_backend.testing import server as server_harness

    for _ in range(50):
        assert server_harness.free_port() + 10000 <= 65535
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy_port = busy.getsockname()[1]

    class FirstBusy(random.Random):
        calls = 0

        def randrange(self, a, b):
            self.calls += 1
            return busy_port if self.calls == 1 else super().randrange(a, b)

    with busy:
        busy.listen()
        rng = FirstBusy(0)
        port = server_harness.free_port(rng)
        assert port != busy_port and rng.calls >= 2 and port in server_harness.SERVER_PORTS


def test_generated_tokens_from_ids_or_from_logprobs():
    """SGLang 0.5.15 (the GPU kit's) has no return_token_ids: the GPU server tests compare the logprobs'
    token strings there, the ids where the server returns them."""
    import pytest

    from sas_backend.testing.server import generated_tokens

    assert generated_tokens({"token_ids": [5, 6], "logprobs": {"tokens": ["a", "b"]}}) == [5, 6]
    assert generated_tokens({"text": " a b", "logprobs": {"tokens": [" a", " b"]}}) == [" a", " b"]
    with pytest.raises(KeyError, match="logprobs"):
        generated_tokens({"text": " a b", "logprobs": None})


def test_an_explicit_sas_commit_wins_over_git(monkeypatch):
    """The device machine's copy of the tree carried a stale .git: the first GPU run's summary named the
    previous session's HEAD. The commit the caller passes is the one recorded."""
    from sas_backend.provenance import git_state, source_checkout

    monkeypatch.setenv("SAS_COMMIT", "0123abcd" * 5)
    assert git_state(source_checkout())["commit"] == "0123abcd" * 5
    monkeypatch.delenv("SAS_COMMIT")
    assert git_state(source_checkout())["commit"] != "0123abcd" * 5
