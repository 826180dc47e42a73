"""The server harness every test and benchmark starts SGLang through."""

from __future__ import annotations

from sas_backend.server_harness import server_cmd


def test_every_server_sleeps_when_idle_once():
    """An idle scheduler without --sleep-on-idle busy-polls a core for the rest of the run: the
    harness adds the flag, and does not repeat it when the caller passed it."""
    cmd = server_cmd("m", "sas", 1234, ["--sas-budget", 512])
    assert cmd.count("--sleep-on-idle") == 1 and cmd[cmd.index("--sas-budget") + 1] == "512"
    assert server_cmd("m", "sas", 1234, ["--sleep-on-idle"]).count("--sleep-on-idle") == 1
