"""The server harness every test and benchmark starts SGLang through."""

from __future__ import annotations

from sas_backend.server_harness import server_cmd


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
    from sas_backend import server_harness

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
    from sas_backend import server_harness

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
    from sas_backend import server_harness

    cases = [({0, 1}, 2, "0|1"), ({0, 1}, 3, "0|1|0"), ({0}, 3, "0|0|0"), (set(range(8)), 2, "0-3|4-7"),
             ({1, 3, 5, 7}, 2, "1,3|5,7"), ({4, 5, 6}, 1, "4-6")]
    for cores, ranks, expected in cases:
        monkeypatch.setattr(server_harness.os, "sched_getaffinity", lambda pid, c=cores: c)
        assert server_harness.cpu_threads_bind(ranks) == expected, (cores, ranks)
