"""Run a function on several CPU ranks (torch.multiprocessing + gloo) and collect results.

Used by the test suite for tensor-parallel math; handy for users testing their own
vocab-parallel code on a laptop.
"""
from __future__ import annotations

import io
import os
import pickle
import tempfile
import time
import traceback
from collections.abc import Callable
from multiprocessing import reduction
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_rl_patches.settings import child_environment, process_environment

START_METHODS = ("spawn", "forkserver")
_default = {"start_method": "spawn"}


def use_forkserver() -> None:
    """Later worlds fork their ranks from one server process that imported torch and megatron-core
    once (`rank_preload`), instead of starting a fresh interpreter per rank. Each rank is still a new
    process with nothing of earlier worlds; the caller's environment, working directory, sys.path and
    stdout/stderr reach it at start as with spawn, only the preloaded modules were imported under the
    environment of the first world's start. Call before the first forkserver world of the process."""
    mp.get_context("forkserver").set_forkserver_preload(["megatron_rl_patches.testing.rank_preload"])
    _default["start_method"] = "forkserver"


def use_spawn() -> None:
    """Later worlds start a fresh interpreter per rank (the default): for ranks that must import
    something before megatron-core is (the slime lane installs slime's patched GPT model first)."""
    _default["start_method"] = "spawn"


class _CallerStdio:
    """The caller's stdout and stderr, duplicated into the rank when it starts (a forkserver's child
    would otherwise write to the server's, not to what the caller has now: pytest's capture)."""

    def __init__(self, fds: tuple[Any, Any] | None = None) -> None:
        self.fds = fds

    def __reduce__(self) -> tuple[Any, ...]:
        return (_CallerStdio, ((reduction.DupFd(1), reduction.DupFd(2)),))

    def attach(self) -> None:
        if self.fds is not None:
            for target, fd in zip((1, 2), self.fds):
                os.dup2(fd.detach(), target)


def _worker(rank: int, world_size: int, init_file: str, call: bytes, queue: Any,
            environ: dict[str, str], stdio: _CallerStdio | None) -> None:
    if stdio is not None:
        stdio.attach()
    adopted = process_environment()  # the caller's environment, adopted whole
    adopted.clear()
    adopted.update(environ)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    # every rank's mesh whole before any rank may finish: a rank done at once (no collective) would
    # otherwise exit while another is still connecting to it ("Connection closed by peer" at its init)
    dist.barrier()
    try:
        fn, args = pickle.loads(call)  # after the environment: the caller's module imports see it
        queue.put((rank, "ok", _pack(fn(rank, world_size, *args))))
    except BaseException:  # noqa: BLE001 - the parent re-raises with this traceback
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def _pack(result: Any) -> bytes:
    """The result as bytes (torch.save): tensors travel by value, not as shared-memory handles
    that vanish when this rank's process exits before the parent reads them."""
    buffer = io.BytesIO()
    torch.save(result, buffer)
    return buffer.getvalue()


def _unpack(payload: bytes) -> Any:
    return torch.load(io.BytesIO(payload), weights_only=False)


class RanksFailed(RuntimeError):
    """A world whose ranks failed: its message every failing rank's traceback (`failures`, one text
    per rank, or why no result came); `summary` the failures' last lines, each once (the error each
    rank raised, named: what a command line shows a user in one line)."""

    def __init__(self, failures: list[str]) -> None:
        super().__init__("multirank run failed\n" + "\n".join(failures))
        self.failures = list(failures)

    @property
    def summary(self) -> str:
        lasts = [next((line.strip() for line in reversed(text.splitlines()) if line.strip()), text)
                 for text in self.failures]
        return "; ".join(dict.fromkeys(lasts))


def run_multirank(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0,
                  start_method: str | None = None) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on `world_size` gloo ranks; return results by rank.

    `fn` must be importable (module level) and its results picklable (move tensors to CPU).
    The default process group is initialized in each rank before `fn` runs. `timeout` bounds the
    whole world (its ranks started, to their exit); `start_method` is "spawn" (default) or "forkserver" (see
    :func:`use_forkserver`, which also changes the default)."""
    method = start_method or _default["start_method"]
    if method not in START_METHODS:
        raise ValueError(f"start_method={method!r}: pass one of {START_METHODS}")
    call = pickle.dumps((fn, args))  # a function that is not importable fails here, in the caller
    ctx: Any = mp.get_context(method)  # typed BaseContext for a str argument, which has no Process
    queue = ctx.Queue()
    stdio = _CallerStdio() if method == "forkserver" else None
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        procs = [
            ctx.Process(target=_worker, args=(rank, world_size, init_file, call, queue, child_environment(), stdio),
                        daemon=True)
            for rank in range(world_size)
        ]
        for proc in procs:
            proc.start()  # the first forkserver world waits here for the server's imports
        deadline = time.monotonic() + timeout
        results: dict[int, Any] = {}
        errors = []
        for _ in procs:
            try:
                rank, kind, value = queue.get(timeout=max(deadline - time.monotonic(), 0.0))
            except Exception as exc:  # queue.Empty: a rank died or hangs without reporting
                codes = [proc.exitcode for proc in procs]
                errors.append(f"no result within {timeout}s ({type(exc).__name__}: {exc}); exit codes by rank: {codes}")
                break
            if kind == "ok":
                results[rank] = _unpack(value)
            else:
                errors.append(f"rank {rank}:\n{value}")
        for proc in procs:
            proc.join(max(deadline - time.monotonic(), 0.0))
            if proc.is_alive():
                proc.kill()
                proc.join()
    if errors:
        raise RanksFailed(errors)
    return [results[rank] for rank in range(world_size)]
