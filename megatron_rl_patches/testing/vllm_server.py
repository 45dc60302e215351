"""A real vLLM server on the loopback for tests and benchmarks (`vllm_server`): vLLM's CPU build
from its own interpreter (the served lane's venv), a model directory, a free port; stopped (its
whole process group) on exit. `vllm serve` looks the distribution "vllm" up, which the CPU build
is not named: the OpenAI server module is started instead."""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

# vLLM's CPU backend sizes its KV cache from this (GiB) and pins OpenMP threads unless told not to
CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}


@dataclass(frozen=True)
class VllmServer:
    url: str
    process: subprocess.Popen
    log: Path

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def server_command(python: str, model: str | Path, port: int, max_model_len: int, max_logprobs: int,
                   extra: tuple[str, ...] = (), dtype: str = "float32") -> list[str]:
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--dtype", dtype,
            "--enforce-eager", "--max-model-len", str(max_model_len), "--max-logprobs", str(max_logprobs),
            "--no-enable-prefix-caching", "--host", "127.0.0.1", "--port", str(port),
            *extra]


def launch(python: str, model: str | Path, log: str | Path, *, max_model_len: int = 256, max_logprobs: int = 20,
           api_key: str | None = None, extra: tuple[str, ...] = (), dtype: str = "float32") -> VllmServer:
    """A vLLM server of `model` started (not yet ready: `serving` waits for it and stops it), so a
    caller can start several at once and let them load side by side."""
    port = free_port()
    env = {**os.environ, **CPU_ENV}
    env.pop("VLLM_API_KEY", None)
    # the server runs in its own venv: a caller's PYTHONPATH (a lane's packages, another Python's) would shadow it
    env.pop("PYTHONPATH", None)
    if api_key is not None:
        env["VLLM_API_KEY"] = api_key
    log = Path(log)
    with open(log, "wb") as out:
        process = subprocess.Popen(server_command(python, model, port, max_model_len, max_logprobs, extra, dtype),
                                   stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return VllmServer(f"http://127.0.0.1:{port}", process, log)


@contextlib.contextmanager
def serving(server: VllmServer, ready_timeout: float = 600.0) -> Iterator[VllmServer]:
    """`server` (from `launch`) once ready; stopped on exit, also when it never got ready."""
    try:
        wait_ready(server, ready_timeout)
        yield server
    finally:
        stop(server.process)


@contextlib.contextmanager
def vllm_server(python: str, model: str | Path, log: str | Path, *, max_model_len: int = 256,
                max_logprobs: int = 20, api_key: str | None = None, extra: tuple[str, ...] = (),
                ready_timeout: float = 600.0, dtype: str = "float32") -> Iterator[VllmServer]:
    """A vLLM server of `model` (in `dtype`, float32 by default; eager, no prefix cache; a tokenizer
    in the directory, which vLLM checks the ids against) on 127.0.0.1, ready (`/health` answers)
    when entered; its output in `log`. `api_key`: the key the server demands (in its environment,
    not on its command line)."""
    server = launch(python, model, log, max_model_len=max_model_len, max_logprobs=max_logprobs, api_key=api_key,
                    extra=extra, dtype=dtype)
    with serving(server, ready_timeout) as ready:
        yield ready


def wait_ready(server: VllmServer, timeout: float) -> None:
    """Until `/health` answers 200; RuntimeError with the log's end if the server exits or the
    time runs out."""
    until = time.monotonic() + timeout
    while time.monotonic() < until:
        if server.process.poll() is not None:
            raise RuntimeError(f"the vLLM server exited with {server.process.returncode} before it was ready:\n"
                               f"{server.log_tail()}")
        try:
            with urllib.request.urlopen(server.url + "/health", timeout=2) as reply:
                if reply.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the vLLM server was not ready within {timeout:g} s:\n{server.log_tail()}")


def stop(process: subprocess.Popen, grace: float = 20.0) -> None:
    """SIGTERM to the server's process group (its engine core and workers), SIGKILL after `grace`."""
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(grace)
