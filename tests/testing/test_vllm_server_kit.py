"""The lanes' vLLM server kit without vLLM: how many servers start at once for the memory there is,
what a dead server says (a signal or a dead worker, not the client's "Connection refused"), and the
KV cache each one holds (the flag, not vLLM's legacy whole-GiB variable)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

from megatron_rl_patches.testing import vllm_server
from megatron_rl_patches.testing.vllm_server import SERVER_PEAK_BYTES, VllmServer, servers_that_fit

GiB = 1 << 30


def test_servers_start_in_waves_that_fit_the_available_memory(monkeypatch):
    assert servers_that_fit(5, available=24 * GiB) == 5  # this kind's 24 GiB: all at once
    assert servers_that_fit(5, available=4 * GiB + 2 * SERVER_PEAK_BYTES) == 2
    assert servers_that_fit(5, available=6 * GiB) == 1  # never fewer than one
    monkeypatch.setattr(vllm_server, "available_bytes", lambda: None)  # memory unknown: all at once
    assert servers_that_fit(3) == 3
    monkeypatch.setattr(vllm_server, "available_bytes", lambda: 5 * GiB)
    assert servers_that_fit(3) == 1


def _sleeper(tmp_path, said: str) -> VllmServer:
    log = tmp_path / "vllm.log"
    log.write_text(f"INFO starting\n{said}\n")
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    return VllmServer("http://127.0.0.1:1", process, log)


def test_a_server_killed_by_a_signal_says_so_and_names_its_log(tmp_path):
    server = _sleeper(tmp_path, "INFO serving")
    try:
        assert server.death() is None
        os.killpg(server.process.pid, signal.SIGKILL)
        server.process.wait(10)
        said = server.death()
        assert said is not None and "killed by SIGKILL" in said and "OOM killer" in said
        assert str(server.log) in said and "INFO serving" in said
    finally:
        vllm_server.stop(server.process)


def test_a_dead_worker_behind_a_live_server_is_named_from_the_log(tmp_path):
    line = "ERROR Worker proc VllmWorker-0 died unexpectedly (exit code: None), shutting down executor."
    server = _sleeper(tmp_path, line)
    try:
        said = server.death()
        assert said is not None and "engine died while the server process lives on" in said and line in said
        assert str(server.log) in said
    finally:
        vllm_server.stop(server.process)


def test_the_kv_cache_is_a_flag_and_the_legacy_variable_is_dropped(monkeypatch, tmp_path):
    command = vllm_server.server_command("python", "m", 1, 256, 20)
    at = command.index("--kv-cache-memory-bytes")
    assert int(command[at + 1]) == vllm_server.KV_CACHE_BYTES < GiB
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "4")  # a user's setting would override the flag in vLLM
    _, env = launched(monkeypatch, tmp_path)
    assert "VLLM_CPU_KVCACHE_SPACE" not in env


def test_a_server_runs_its_model_in_the_engine_cores_process(monkeypatch, tmp_path):
    """Two processes a server, not three: the uni executor, which vLLM's CPU backend turns back into
    its multiprocess one unless VLLM_ENABLE_V1_MULTIPROCESSING=0 is in the server's environment."""
    command = vllm_server.server_command("python", "m", 1, 256, 20)
    at = command.index("--distributed-executor-backend")
    assert command[at + 1] == "uni"
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")  # a caller's own setting does not undo it
    argv, env = launched(monkeypatch, tmp_path)
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert argv[argv.index("--distributed-executor-backend") + 1] == "uni"


def launched(monkeypatch, tmp_path) -> tuple[list[str], dict[str, str]]:
    """The command line and environment `launch` starts its server with (recorded, nothing started)."""
    seen: dict = {}

    class Recorder:
        def __init__(self, argv, **kwargs):
            seen.update(argv=argv, env=kwargs["env"])
            self.pid = 0

    monkeypatch.setattr(vllm_server.subprocess, "Popen", Recorder)
    vllm_server.launch("python", "m", tmp_path / "log")
    return seen["argv"], seen["env"]


def test_a_free_port_is_below_the_ephemeral_range_and_never_handed_out_twice(monkeypatch, tmp_path):
    """Every outgoing connection takes its local port from the ephemeral range; a server's port from
    there could be taken between the probe and the server's bind (seen: "Address already in use")."""
    ranged = tmp_path / "ip_local_port_range"
    ranged.write_text("32768\t60999\n")
    monkeypatch.setattr(vllm_server, "EPHEMERAL_RANGE", ranged)
    monkeypatch.setattr(vllm_server, "_handed_out", set())
    ports = [vllm_server.free_port() for _ in range(20)]
    assert all(10000 <= port < 32768 for port in ports) and len(set(ports)) == 20
    ranged.write_text("1024\t60999\n")  # no room below the range: the kernel's pick, as before
    assert vllm_server.ports_below_ephemeral() == range(10000, 1024)
    assert vllm_server.free_port() >= 1024
    ranged.unlink()  # unreadable: the kernel's pick
    assert len(vllm_server.ports_below_ephemeral()) == 0 and vllm_server.free_port() > 0


def test_a_port_something_listens_on_is_never_handed_out(monkeypatch, tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        taken.listen()
        ranged = tmp_path / "ip_local_port_range"
        ranged.write_text(f"{port + 1}\t60999\n")
        monkeypatch.setattr(vllm_server, "EPHEMERAL_RANGE", ranged)
        monkeypatch.setattr(vllm_server, "LOW_PORTS", range(port, port + 1))  # the only candidate: taken
        monkeypatch.setattr(vllm_server, "_handed_out", set())
        assert vllm_server.free_port() != port
