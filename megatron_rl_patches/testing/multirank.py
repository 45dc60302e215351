"""Run a function on several CPU ranks (torch.multiprocessing + gloo) and collect results.

Used by the test suite for tensor-parallel math; handy for users testing their own
vocab-parallel code on a laptop.
"""
from __future__ import annotations

import io
import os
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, world_size: int, init_file: str, fn: Callable[..., Any], args: tuple, queue: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
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


def run_multirank(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on `world_size` gloo ranks; return results by rank.

    `fn` must be importable (module level) and its results picklable (move tensors to CPU).
    The default process group is initialized in each rank before `fn` runs.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        procs = [
            ctx.Process(target=_worker, args=(rank, world_size, init_file, fn, args, queue), daemon=True)
            for rank in range(world_size)
        ]
        for proc in procs:
            proc.start()
        results: dict[int, Any] = {}
        errors = []
        for _ in procs:
            try:
                rank, kind, value = queue.get(timeout=timeout)
            except Exception as exc:  # queue.Empty: a rank died without reporting
                codes = [proc.exitcode for proc in procs]
                errors.append(f"no result within {timeout}s ({type(exc).__name__}: {exc}); exit codes by rank: {codes}")
                break
            if kind == "ok":
                results[rank] = _unpack(value)
            else:
                errors.append(f"rank {rank}:\n{value}")
        for proc in procs:
            proc.join(timeout)
            if proc.is_alive():
                proc.kill()
    if errors:
        raise RuntimeError("multirank run failed\n" + "\n".join(errors))
    return [results[rank] for rank in range(world_size)]
