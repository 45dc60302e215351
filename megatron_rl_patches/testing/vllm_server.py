"""A real vLLM server on the loopback for tests and benchmarks (`vllm_server`): vLLM's CPU build
from its own interpreter (the served lane's venv), a model directory, a free port; stopped (its
whole process group) on exit. `vllm serve` looks the distribution "vllm" up, which the CPU build
is not named: the OpenAI server module is started instead."""
from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from megatron_rl_patches.settings import child_environment

# vLLM's CPU backend pins OpenMP threads unless told not to. Its engine's model runner runs inside the
# engine core's process (`--distributed-executor-backend uni`, which the CPU backend takes only with
# VLLM_ENABLE_V1_MULTIPROCESSING=0; the API server still starts its engine core as a process of its
# own): two processes a server, each importing vLLM and torch, where the default spawns a third for its
# worker. One server ready in 17.5 s against 24.0 s, five at once in 48.3 s against 71.4 s (2 cores).
CPU_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
# The KV cache a test server holds (`--kv-cache-memory-bytes`): vLLM's CPU backend touches all of it at
# start, and its legacy VLLM_CPU_KVCACHE_SPACE counts whole GiB. A tiny model at --max-model-len 256
# needs a few MiB; 128 MiB keeps a server at ~2.1 GiB resident where 1 GiB of cache made it ~3 GiB.
KV_CACHE_BYTES = 128 << 20
# What one such server holds at its peak (measured: 2.15 GiB resident while it loads, fp32 and bf16),
# with room: the lanes start as many at once as the machine's available memory takes (`servers_that_fit`)
SERVER_PEAK_BYTES = int(2.5 * (1 << 30))
# Imported first by every process of a test server (sitecustomize.py): vLLM's CPU attention runs AMX
# tile instructions for bf16 without asking Linux for them (SIGILL on an Intel Xeon with AMX)
STARTUP = Path(__file__).resolve().parent / "server_startup"
# What vLLM writes when its engine or one of its workers is gone
DEATH_MARKS = ("died unexpectedly", "EngineDeadError", "EngineCore encountered a fatal error")


@dataclass(frozen=True)
class VllmServer:
    url: str
    process: subprocess.Popen
    log: Path
    api_key: str | None = field(default=None, repr=False)  # sent to /health (serve-teacher asks for it there too)

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def death(self) -> str | None:
        """Why the server is dead (its process exited, or its log says its engine or a worker died),
        naming its log; None while it is alive. A test that then sees only "Connection refused"
        attaches this (the lanes' conftest)."""
        code = self.process.poll()
        said = [line.strip() for line in self.log.read_text(errors="replace").splitlines()
                if any(mark in line for mark in DEATH_MARKS)] if self.log.exists() else []
        if code is None and not said:
            return None
        if code is None:
            how = "its engine died while the server process lives on"
        elif code < 0:
            how = f"killed by {signal.Signals(-code).name}"
        else:
            how = f"exited with {code}"
        if code is not None and code < 0 or any("died unexpectedly" in line for line in said):
            how += " (a process killed by a signal it did not raise itself is most often the kernel's OOM killer: " \
                   "see `dmesg` and the machine's available memory)"
        first = f"; its log says: {said[0]}" if said else ""
        return f"the vLLM server {self.url} died: {how}{first}; its log: {self.log}\n{self.log_tail(15)}"


# Where free_port looks first: below the kernel's ephemeral range, which every outgoing connection takes
# its local port from. A port bound with 0 is from that range too, and between the probe and the server's
# own bind (seconds: vLLM imports first) a lane's client connection took one ("Address already in use",
# the example's server as pasted in the served lane). Handed-out ports are remembered per process.
LOW_PORTS = range(10000, 32768)
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_handed_out: set[int] = set()
# the OS's randomness, not `random`'s global state: two processes a caller seeded alike (a training loop's
# random.seed) would otherwise try the same ports in the same order
PICK = random.SystemRandom()


def ports_below_ephemeral() -> range:
    """`LOW_PORTS` cut below the kernel's ephemeral range (empty where it cannot be read)."""
    try:
        first = int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return range(0)
    return range(LOW_PORTS.start, min(LOW_PORTS.stop, first))


def free_port() -> int:
    """A loopback port nothing listens on, from below the ephemeral range where there is one (no
    outgoing connection can take it before the server binds it), else one the kernel picks."""
    low = ports_below_ephemeral()
    for port in PICK.sample(low, min(64, len(low))):
        if port in _handed_out:
            continue
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def server_command(python: str, model: str | Path, port: int, max_model_len: int, max_logprobs: int,
                   extra: tuple[str, ...] = (), dtype: str = "float32") -> list[str]:
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--dtype", dtype,
            "--enforce-eager", "--max-model-len", str(max_model_len), "--max-logprobs", str(max_logprobs),
            "--no-enable-prefix-caching", "--kv-cache-memory-bytes", str(KV_CACHE_BYTES),
            "--distributed-executor-backend", "uni", "--host", "127.0.0.1", "--port", str(port), *extra]


def serve_teacher_command(python: str, model: str | Path, port: int, max_model_len: int, max_logprobs: int,
                          extra: tuple[str, ...] = (), dtype: str = "float32") -> list[str]:
    """`megatron-rl-patches serve-teacher` run by vLLM's interpreter, with the test servers' engine
    arguments (its prefix cache is the server's own)."""
    engine = server_command(python, model, port, max_model_len, max_logprobs, extra, dtype)[5:]
    engine = [word for word in engine if word != "--no-enable-prefix-caching"]
    at = engine.index("--host")
    return [python, "-m", "megatron_rl_patches", "serve-teacher", str(model), "--host", "127.0.0.1", "--port",
            str(port), "--", *engine[:at], *engine[at + 4:]]


def server_path(serve_teacher: bool) -> list[str]:
    """The PYTHONPATH of a test server's processes: `STARTUP` (its sitecustomize asks Linux for the
    AMX tile state in each of them) and, for `serve-teacher`, this checkout's root."""
    return [str(STARTUP)] + ([str(Path(__file__).resolve().parents[2])] if serve_teacher else [])


def launch(python: str, model: str | Path, log: str | Path, *, max_model_len: int = 256, max_logprobs: int = 20,
           api_key: str | None = None, extra: tuple[str, ...] = (), dtype: str = "float32",
           serve_teacher: bool = False) -> VllmServer:
    """A vLLM server of `model` started (not yet ready: `serving` waits for it and stops it), so a
    caller can start several at once and let them load side by side. `serve_teacher`: this package's
    `serve-teacher` (vLLM's engine in process) instead of vLLM's own server, the package importable
    from vLLM's interpreter through PYTHONPATH (this checkout's root, nothing else)."""
    port = free_port()
    env = child_environment(CPU_ENV)
    env.pop("VLLM_API_KEY", None)
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override --kv-cache-memory-bytes
    # the server runs in its own venv: a caller's PYTHONPATH (a lane's packages, another Python's) would
    # shadow it; only the startup folder (the AMX request) and, for serve-teacher, this checkout's root
    env["PYTHONPATH"] = os.pathsep.join(server_path(serve_teacher))
    command = server_command(python, model, port, max_model_len, max_logprobs, extra, dtype)
    if serve_teacher:
        command = serve_teacher_command(python, model, port, max_model_len, max_logprobs, extra, dtype)
    if api_key is not None:
        env["VLLM_API_KEY"] = api_key
    log = Path(log)
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return VllmServer(f"http://127.0.0.1:{port}", process, log, api_key)


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


def available_bytes() -> int | None:
    """The machine's available memory (Linux's MemAvailable), or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def servers_that_fit(wanted: int, reserve_bytes: int = 4 << 30, available: int | None = None) -> int:
    """How many of `wanted` servers to start at once so their peaks fit the available memory with
    `reserve_bytes` left for the tests' own process (at least one; all when memory cannot be read)."""
    available = available_bytes() if available is None else available
    if available is None:
        return wanted
    return max(1, min(wanted, (available - reserve_bytes) // SERVER_PEAK_BYTES))


def wait_ready(server: VllmServer, timeout: float) -> None:
    """Until `/health` answers 200; RuntimeError with the log's end if the server exits or the
    time runs out."""
    until = time.monotonic() + timeout
    while time.monotonic() < until:
        if server.process.poll() is not None:
            raise RuntimeError(f"the vLLM server exited with {server.process.returncode} before it was ready "
                               f"(its log: {server.log}):\n{server.log_tail()}")
        try:
            headers = {"Authorization": f"Bearer {server.api_key}"} if server.api_key else {}
            with urllib.request.urlopen(urllib.request.Request(server.url + "/health", headers=headers),
                                        timeout=2) as reply:
                if reply.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the vLLM server was not ready within {timeout:g} s (its log: {server.log}):\n"
                       f"{server.log_tail()}")


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
