"""Start and stop real SGLang servers for the end-to-end tests (CPU, the default model)."""

from __future__ import annotations

import os
import pathlib
import signal
import socket
import subprocess
import sys
import tempfile
import time

import requests
import torch

# On a GPU host the servers run on CUDA (FlashInfer, Triton, CUDA graphs); otherwise on CPU.
ON_GPU = torch.cuda.is_available()

REPO = pathlib.Path(__file__).resolve().parents[2]
DEFAULT_MODEL = REPO / "models" / "SmolLM2-135M-Instruct"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_env(extra=None) -> dict:
    """The server's environment: the CPU engine switches (not on GPU), no inherited SAS_* vars."""
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    if ON_GPU:
        env.pop("TRITON_INTERPRET", None)
    else:
        env.update({"SGLANG_USE_CPU_ENGINE": "1", "TRITON_INTERPRET": "1"})
    for k in list(env):  # flags, not inherited variables, configure each test server
        if k.startswith("SAS_"):
            del env[k]
    env.update(extra or {})
    return env


def server_cmd(model, backend: str, port: int, extra_args=(), entry="launch_server") -> list:
    """`python -m sglang.launch_server ...`, or `sglang serve ...` with entry="serve"."""
    if entry == "serve":
        launcher = [str(pathlib.Path(sys.executable).parent / "sglang"), "serve"]
    else:
        launcher = [sys.executable, "-m", "sglang.launch_server"]
    return [
        *launcher,
        "--model-path", str(model),
        "--attention-backend", backend,
        *([] if ON_GPU else ["--device", "cpu", "--max-total-tokens", "16384"]),
        "--host", "127.0.0.1", "--port", str(port),
        "--random-seed", "0",
        "--log-level", "info",
        *map(str, extra_args),
    ]


class Server:
    """A running `python -m sglang.launch_server` on this machine; its log goes to a temp file."""

    def __init__(self, model=DEFAULT_MODEL, backend="sas", extra_args=(), env=None, startup_timeout=600,
                 entry="launch_server"):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"sglang-{backend}-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(
            server_cmd(model, backend, self.port, extra_args, entry),
            stdout=self.log, stderr=subprocess.STDOUT, env=cpu_env(env), start_new_session=True,
        )
        self._wait_ready(startup_timeout)

    def _wait_ready(self, timeout):
        t0 = time.time()
        while time.time() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} during startup:\n{self.log_tail()}")
            try:
                if requests.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(1)
        self.stop()
        raise TimeoutError(f"server not ready after {timeout}s:\n{self.log_tail()}")

    def log_text(self) -> str:
        return pathlib.Path(self.log.name).read_text(errors="replace")

    def log_tail(self, n=60) -> str:
        return "\n".join(self.log_text().splitlines()[-n:])

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def launch_expect_failure(model=DEFAULT_MODEL, backend="sas", extra_args=(), env=None, timeout=600):
    """Launch a server that must refuse to start; returns (exit code, full output)."""
    port = free_port()
    proc = subprocess.Popen(
        server_cmd(model, backend, port, extra_args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        env=cpu_env(env), start_new_session=True, text=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"server did not exit within {timeout}s; output tail:\n{out[-4000:]}")
    return proc.returncode, out


def complete(url, prompt, max_tokens=16, **extra) -> dict:
    body = {"model": "default", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, **extra}
    r = requests.post(f"{url}/v1/completions", json=body, timeout=600)
    r.raise_for_status()
    return r.json()
