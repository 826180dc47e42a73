"""Start and stop real SGLang servers on this machine, for the end-to-end tests and the benchmarks.

`Server(...)` launches `python -m sglang.launch_server` (or `sglang serve`) with the attention
backend asked for, in its own session, its output in a temporary log file, and returns once
`/health` answers (SGLang's own `sglang.utils.wait_for_http_ready` polls it); if the server exits
during startup the error carries the log's tail. `stop()` (or leaving the `with` block) kills
the whole process group (launcher, scheduler, detokenizer).

A server must not outlive the process that started it (an idle SGLang server keeps CPU cores
busy). Besides `stop()`:
- at interpreter exit (atexit), and on SIGTERM/SIGHUP (which skip atexit), every server still
  running is terminated;
- on Linux each launcher also gets SIGTERM from the kernel when the thread that started it dies,
  even by SIGKILL, which no handler sees (PR_SET_PDEATHSIG; SGLang's workers in turn die with the
  launcher). Start servers from a thread that lives as long as they should: the main thread.

On a GPU host the servers run on CUDA (FlashInfer, Triton, CUDA graphs); otherwise on the CPU
engine (`cpu_env`).
"""

from __future__ import annotations

import atexit
import ctypes
import os
import pathlib
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading

import requests
import torch

from sas_backend.paths import default_model_dir, source_checkout

ON_GPU = torch.cuda.is_available()
DEFAULT_MODEL = default_model_dir()


def default_gate(model) -> pathlib.Path:
    """The gate `serve/serve.sh` serves `model` with: the shipped checkpoint that fits it, else a
    seeded-init one (made once under models/gates/). Needs a source checkout (serve/default_gate.py)."""
    repo = source_checkout()
    if repo is None:
        raise RuntimeError("default_gate needs the repository's serve/default_gate.py; pass a gate path")
    out = subprocess.run([sys.executable, str(repo / "serve" / "default_gate.py"), "--model", str(model)],
                         check=True, capture_output=True, text=True)
    return pathlib.Path(out.stdout.strip().splitlines()[-1])

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# looked up here, not in the forked child, which should do as little as possible before exec
_PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None
_live: dict = {}  # pid (= process-group id) -> Popen of every server started and not yet stopped
_lock = threading.RLock()  # reentrant: the signal handler may run while the main thread holds it
_exit_hooks_installed = False


# Ports for test servers: below the kernel's ephemeral range (where bind(0) lands, 32768-60999 on Linux)
# because SGLang derives ports from --port: 0.5.15 refuses to start when port + 10000 (its gRPC port)
# exceeds 65535, which the first GPU run hit (2026-11-27) with ports from bind(0).
SERVER_PORTS = range(20000, 32000)


def free_port(rng=None) -> int:
    """A port in SERVER_PORTS that is free now (random, so parallel test workers rarely collide)."""
    rng = rng or random.Random()
    for _ in range(200):
        port = rng.randrange(SERVER_PORTS.start, SERVER_PORTS.stop)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {SERVER_PORTS.start}-{SERVER_PORTS.stop - 1} after 200 tries")


# Variables every server this process starts gets unless the caller's `env` names them (None there: unset). The
# test suite pins SAS_DENSE_BELOW=0 (tests/conftest.py): its servers check the sparse path itself at short
# contexts, where the CPU default (budget + 3072 tokens) decodes densely; the test of that default unsets it.
PINNED_ENV: dict = {}


def cpu_env(extra=None) -> dict:
    """The server's environment: the CPU engine switches (not on GPU), no inherited SAS_* vars, `PINNED_ENV`,
    then `extra` (a None value removes that variable)."""
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    if ON_GPU:
        env.pop("TRITON_INTERPRET", None)
    else:
        env.update({"SGLANG_USE_CPU_ENGINE": "1", "TRITON_INTERPRET": "1"})
    for k in list(env):  # flags, not inherited variables, configure each test server
        if k.startswith("SAS_"):
            del env[k]
    env.update(PINNED_ENV)
    for k, v in (extra or {}).items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    return env


# SGLang's scheduler watchdog (300 s by default) is sized for GPU forwards; on CPU a long-context batch
# legitimately takes minutes
CPU_WATCHDOG_S = 3600

# The models' configs say bf16 ("auto"), but a CPU without avx512_bf16/amx_bf16 (the AVX2 AMD EPYC that CI
# sometimes draws) multiplies bf16 matrices ~100x slower than fp32 (0.9 vs 110 GFLOP/s at 1024^2): a
# 1000-token prefill of the 135M model took 16 s and the CI soak 10 min instead of 2.5. fp32 is fast on
# every x86 CPU and gives every CI machine the same numerics; a caller's --dtype wins (serve/serve.sh
# applies the same rule for users, keeping bf16 where the CPU has it).
CPU_DTYPE = "float32"


def launch_flags(extra_args=()) -> list:
    """`extra_args` as strings, plus the flags every harness server gets unless given (server_cmd says
    which and why); a record of a run keeps these, so that it says what the server really ran with."""
    flags = [str(a) for a in extra_args]
    if "--sleep-on-idle" not in flags:
        flags.append("--sleep-on-idle")
    if not ON_GPU and "--watchdog-timeout" not in flags:
        flags += ["--watchdog-timeout", str(CPU_WATCHDOG_S)]
    if not ON_GPU and "--dtype" not in flags:
        flags += ["--dtype", CPU_DTYPE]
    return flags


def cpu_threads_bind(ranks: int) -> str:
    """SGLANG_CPU_OMP_THREADS_BIND for `ranks` tensor-parallel ranks on CPU (entries separated by `|`): the
    cores this process may run on (its affinity: under tests/run.sh, the xdist worker's share), split into
    equal runs per rank, or shared round-robin when there are fewer cores than ranks. E.g. cores {0, 1}:
    2 ranks "0|1", 3 ranks "0|1|0"; cores 0-7, 2 ranks "0-3|4-7"."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < ranks:
        return "|".join(str(cores[r % len(cores)]) for r in range(ranks))
    per = len(cores) // ranks
    runs = [cores[r * per:(r + 1) * per] for r in range(ranks)]
    return "|".join(f"{run[0]}-{run[-1]}" if run[-1] - run[0] == len(run) - 1 and len(run) > 1
                    else ",".join(map(str, run)) for run in runs)


def server_cmd(model, backend: str, port: int, extra_args=(), entry="launch_server", python=None) -> list:
    """`python -m sglang.launch_server ...`, or `sglang serve ...` with entry="serve". Always with
    `--sleep-on-idle`: an idle scheduler otherwise busy-polls a core (93% of one on the 2-core CI
    machine, 1% with the flag), slowing whatever runs beside it; it changes no output. On CPU also
    `--watchdog-timeout CPU_WATCHDOG_S` unless given: SGLang kills a server whose one forward batch
    exceeds 300 s, and on 2 cores a batch extending a cached 32K-token prefix for 3 requests takes longer.
    On CPU also `--dtype float32` unless given (CPU_DTYPE says why).
    python: the interpreter (another venv's), default this one."""
    extra_args = launch_flags(extra_args)
    python = str(python or sys.executable)
    if entry == "serve":
        launcher = [str(pathlib.Path(python).parent / "sglang"), "serve"]
    else:
        launcher = [python, "-m", "sglang.launch_server"]
    return [
        *launcher,
        "--model-path", str(model),
        "--attention-backend", backend,
        *([] if ON_GPU else ["--device", "cpu", "--max-total-tokens", "16384"]),
        "--host", "127.0.0.1", "--port", str(port),
        "--random-seed", "0",
        "--log-level", "info",
        *extra_args,
    ]


# ------------------------------------------------------------------------- process lifetime
def _die_with_parent(parent_pid: int) -> None:
    """In the forked child, before exec: ask the kernel for SIGTERM when the parent dies."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, int(signal.SIGTERM))
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def _spawn(cmd: list, env: dict, **popen_kwargs) -> subprocess.Popen:
    """Popen in a new session (one killpg reaches all of the server's processes), remembered
    until `_terminate` so that exit and signal hooks can end it."""
    _install_exit_hooks()
    parent = os.getpid()
    proc = subprocess.Popen(cmd, env=env, start_new_session=True,
                            preexec_fn=lambda: _die_with_parent(parent), **popen_kwargs)
    with _lock:
        _live[proc.pid] = proc
    return proc


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:  # already gone
        pass


def _terminate(procs) -> None:
    """SIGKILL to each process group still running, then reap the launchers. Not SIGTERM: these servers
    hold nothing a drain would save (their caches die with them), and SGLang's SIGTERM path costs 4-6 s a
    server (a scheduler signalled with its group trips the crash handler, which sleeps 5 s before its
    diagnostics): about 2.5 min of a suite that starts ~25 servers."""
    running = [p for p in procs if p.poll() is None]
    for p in running:
        _signal_group(p, signal.SIGKILL)
    for p in running:
        p.wait()
    with _lock:
        for p in procs:
            _live.pop(p.pid, None)


def _terminate_all() -> None:
    with _lock:
        procs = list(_live.values())
    _terminate(procs)


def _on_signal(signum, frame) -> None:
    """End the servers, then die of the same signal as without this handler."""
    _terminate_all()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _install_exit_hooks() -> None:
    """Once per process: atexit, and SIGTERM/SIGHUP where nobody else handles them (their
    default action kills the interpreter without running atexit)."""
    global _exit_hooks_installed
    if _exit_hooks_installed:
        return
    _exit_hooks_installed = True
    atexit.register(_terminate_all)
    if threading.current_thread() is threading.main_thread():  # signal.signal works only there
        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) is signal.SIG_DFL:
                signal.signal(sig, _on_signal)


# --------------------------------------------------------------------------------- servers
class Server:
    """A running `python -m sglang.launch_server` on this machine; its log goes to a temp file."""

    def __init__(self, model=DEFAULT_MODEL, backend="sas", extra_args=(), env=None, startup_timeout=600,
                 entry="launch_server", python=None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"sglang-{backend}-", suffix=".log", delete=False)
        self.proc = _spawn(server_cmd(model, backend, self.port, extra_args, entry, python), cpu_env(env),
                           stdout=self.log, stderr=subprocess.STDOUT)
        self._wait_ready(startup_timeout)

    def _wait_ready(self, timeout):
        # imported here: sglang.utils pulls in SGLang's runtime (seconds), needed only once a server starts
        from sglang.utils import wait_for_http_ready

        try:
            wait_for_http_ready(f"{self.url}/health", timeout=timeout, process=self.proc, request_timeout=2)
        except (RuntimeError, TimeoutError):  # the helper's messages name neither the exit code nor the log
            if self.proc.poll() is not None:
                self.stop()  # forgets it (its workers die with it: SGLang sets their parent-death signal)
                raise RuntimeError(
                    f"server exited with {self.proc.returncode} during startup:\n{self.log_tail()}") from None
            self.stop()
            raise TimeoutError(f"server not ready after {timeout}s:\n{self.log_tail()}") from None

    def log_text(self) -> str:
        return pathlib.Path(self.log.name).read_text(errors="replace")

    def log_tail(self, n=60) -> str:
        return "\n".join(self.log_text().splitlines()[-n:])

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self):
        _terminate([self.proc])

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def launch_expect_failure(model=DEFAULT_MODEL, backend="sas", extra_args=(), env=None, timeout=600):
    """Launch a server that must refuse to start; returns (exit code, full output)."""
    proc = _spawn(server_cmd(model, backend, free_port(), extra_args), cpu_env(env),
                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _signal_group(proc, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"server did not exit within {timeout}s; output tail:\n{out[-4000:]}")
    finally:
        with _lock:
            _live.pop(proc.pid, None)
    return proc.returncode, out


def generated_tokens(choice: dict) -> list:
    """The generated tokens of one /v1/completions choice: its `token_ids` where the server returns them
    (`return_token_ids=True`, SGLang >= 0.5.21), else the token strings of its logprobs (pass
    `logprobs=N`): SGLang 0.5.15, the GPU kit's, has no return_token_ids and ignores it."""
    if "token_ids" in choice:
        return choice["token_ids"]
    logprobs = choice.get("logprobs") or {}
    if "tokens" not in logprobs:
        raise KeyError("the choice has neither token_ids nor logprobs tokens: request logprobs=N as well")
    return logprobs["tokens"]


def complete(url, prompt, max_tokens=16, **extra) -> dict:
    body = {"model": "default", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, **extra}
    r = requests.post(f"{url}/v1/completions", json=body, timeout=600)
    r.raise_for_status()
    return r.json()
