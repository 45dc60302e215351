"""A real sglang-router (0.3.2, the served lane installs it beside vLLM) in front of engine
servers on the loopback, for tests that ask what a router passes: started on free ports (its
Prometheus listener too: the default port is fixed, so a second router on a machine would panic),
ready when it has registered its workers, stopped with its whole process group (the router renames its
process `sglang::router`, so a search by command line misses it)."""
from __future__ import annotations

import contextlib
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from megatron_rl_patches.settings import child_environment
from megatron_rl_patches.testing.vllm_server import VllmServer, free_port, serving


def router_command(router: str | Path, workers: list[str], port: int, metrics_port: int) -> list[str]:
    return [str(router), "launch", "--worker-urls", *workers, "--host", "127.0.0.1", "--port", str(port),
            "--policy", "round_robin", "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port)]


@contextlib.contextmanager
def sglang_router(router: str | Path, workers: list[str], log: str | Path,
                  ready_timeout: float = 60.0) -> Iterator[VllmServer]:
    """sglang-router's console script `router` in front of `workers` (their URLs), ready when
    entered; its output in `log`."""
    port, metrics_port = free_port(), free_port()
    env = child_environment()
    env.pop("PYTHONPATH", None)
    log = Path(log)
    with open(log, "wb") as out:
        process = subprocess.Popen(router_command(router, workers, port, metrics_port), stdout=out,
                                   stderr=subprocess.STDOUT, env=env, start_new_session=True)
    with serving(VllmServer(f"http://127.0.0.1:{port}", process, log), ready_timeout) as ready:
        wait_for_workers(ready.url, ready_timeout)
        yield ready


def wait_for_workers(url: str, timeout: float) -> None:
    """Until the router has registered its workers: its `/health` answers before (its workers are
    registered in the background), and `/v1/models` answers 503 until then."""
    until = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=5):
                return
        except (urllib.error.URLError, OSError):
            if time.monotonic() > until:
                raise RuntimeError(f"the router at {url} registered no worker within {timeout:g} s") from None
            time.sleep(0.5)
