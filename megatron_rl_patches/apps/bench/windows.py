"""Step time of split train steps with overlap-grad-reduce: `grad_windows` against upstream and
against `overlap_grad_reduce=False`, on 2 gloo ranks (tiny GPT, real megatron-core DDP).

Two loads: a steady window (2 schedule calls of 1 microbatch per step: upstream is right there
from 0.16 on) and split windows (1, then 3 calls per step: upstream is wrong or crashes). The
variants run interleaved, one step each per round; medians over the rounds, with min-max spread.
"""
# lazy imports: import cost: torch and megatron-core load when a benchmark runs (in its case workers mostly)
from __future__ import annotations

import os
import statistics
import time
from typing import Any

import megatron_rl_patches
from megatron_rl_patches.apps.bench import outputs
from megatron_rl_patches.apps.quiet import hide_import_notes

LOADS = {"steady (2 calls/step)": [[1, 1], [1, 1]], "split (1 then 3 calls/step)": [[1], [1, 1, 1]]}
VARIANTS = ("overlap_grad_reduce=False", "overlap, unpatched", "overlap + grad_windows")


def _time_variant(env: Any, rank: int, variant: str, windows: list, setups: dict) -> float | str:
    import torch

    from megatron_rl_patches.testing import windows_loop as wl

    if variant not in setups:
        setups[variant] = wl.build(env, {"overlap_grad_reduce": variant != VARIANTS[0]}, "adam")
    if variant == VARIANTS[2]:
        megatron_rl_patches.apply(only="grad_windows", strict=True)
    try:
        torch.distributed.barrier()
        start = time.perf_counter()
        wl.run_windows(setups[variant], windows, rank=rank)
        return (time.perf_counter() - start) / len(windows) * 1e3
    except AssertionError as exc:
        setups.pop(variant)  # a crashed DDP is left half-way: rebuild it next round
        return f"crashes ({str(exc)[:40]}...)"
    finally:
        megatron_rl_patches.revert()


def _ranks(rank: int, world_size: int, rounds: int) -> dict:
    from megatron_rl_patches.testing.megatron_cpu import megatron_world

    hide_import_notes()  # in each rank's process
    samples: dict = {}
    with megatron_world("cpu") as env:
        for load, windows in LOADS.items():
            setups: dict = {}
            for _ in range(rounds + 1):  # the first round warms up
                for variant in VARIANTS:
                    value = _time_variant(env, rank, variant, windows, setups)
                    samples.setdefault((load, variant), []).append(value)
    return {key: values[1:] for key, values in samples.items()}


def _row(load: str, variant: str, values: list, reference: float | None) -> dict:
    crashed = [v for v in values if isinstance(v, str)]
    if crashed:
        return {"load": load, "variant": variant, "median_ms": None, "spread_ms": "", "vs_sync": None,
                "note": crashed[0]}
    median = statistics.median(values)
    wrong = variant == VARIANTS[1] and load.startswith("split")
    return {"load": load, "variant": variant, "median_ms": median, "spread_ms": f"{min(values):.2f}-{max(values):.2f}",
            "vs_sync": median / reference if reference else None,
            "note": "gradients silently wrong (megatron-core >= 0.16)" if wrong else ""}


def run(quick: bool = False, out_dir: str | None = None) -> list[dict]:
    """Print per-step times (ms, rank 0); write windows.csv into `out_dir`."""
    hide_import_notes()
    from megatron_rl_patches.testing.multirank import run_multirank

    rounds = 5 if quick else 15
    samples = run_multirank(_ranks, 2, rounds, timeout=900)[0]
    rows = []
    for load in LOADS:
        sync = statistics.median(samples[(load, VARIANTS[0])])
        rows += [_row(load, variant, samples[(load, variant)], sync) for variant in VARIANTS]
    columns = ["load", "variant", "median_ms", "spread_ms", "vs_sync", "note"]
    outputs.print_table(rows, columns,
                       title=f"accumulation windows: ms per optimizer step, 2 gloo ranks, {rounds} rounds")
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        outputs.write_csv(rows, os.path.join(out_dir, "windows.csv"), columns)
    return rows
