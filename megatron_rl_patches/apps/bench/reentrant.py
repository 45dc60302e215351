"""Wrapper overhead of the re-entrant patches, per call: what a training loop pays for them.

Measured on real megatron-core DDP (hook toggles) and on a DDP stand-in (train() guard), each
unpatched and patched in the same run; the ratio is what matters, not the absolute time.
"""
# lazy imports: import cost: torch and megatron-core load when a benchmark runs (in its case workers mostly)
from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import megatron_rl_patches as mrp
from megatron_rl_patches.apps.bench import outputs
from megatron_rl_patches.apps.quiet import hide_import_notes
from megatron_rl_patches.reentrant import reentrant_train
from megatron_rl_patches.testing.fake_ddp import FakeDDP


def _per_call_us(fn: Callable[[], Any], calls: int, repeats: int = 5) -> float:
    """Median over `repeats` of the mean time of one call, in microseconds."""
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(samples)


def _guard_rows(calls: int) -> list[dict]:
    chunks = [FakeDDP(), FakeDDP()]

    def train(rollout_id: int, model: list) -> int:
        return rollout_id

    guarded = reentrant_train(train)
    bare = _per_call_us(lambda: train(0, chunks), calls)
    wrapped = _per_call_us(lambda: guarded(0, chunks), calls)
    return [
        _overhead_row("train() guard, 2 chunks (stand-in DDP)", bare, wrapped),
    ]


def _hook_rows(calls: int) -> list[dict]:
    from megatron_rl_patches.testing.megatron_cpu import build_tiny_gpt, megatron_on_cpu, wrap_ddp

    rows = []
    with megatron_on_cpu():
        ddp = wrap_ddp(build_tiny_gpt(), use_distributed_optimizer=True, overlap_param_gather=True)

        def cycle() -> None:
            ddp.disable_forward_pre_hook(param_sync=False)
            ddp.enable_forward_pre_hook()

        bare = _per_call_us(cycle, calls)
        crash = _unpatched_repeat_crash(ddp)
        mrp.apply(only=["ddp_hooks"])
        try:
            patched = _per_call_us(cycle, calls)
            ddp.disable_forward_pre_hook(param_sync=False)
            repeat = _per_call_us(lambda: ddp.disable_forward_pre_hook(param_sync=False), calls)
            ddp.enable_forward_pre_hook()
        finally:
            mrp.revert(["ddp_hooks"])
    rows.append(_overhead_row("DDP hook disable+enable cycle (first-call path)", bare, patched))
    rows.append({"case": "repeated disable_forward_pre_hook", "unpatched_us": None, "patched_us": repeat,
                 "overhead_us": None, "note": f"unpatched: crashes ({crash})" if crash else "unpatched: no crash"})
    return rows


def _unpatched_repeat_crash(ddp: Any) -> str | None:
    """Call disable_forward_pre_hook twice on the unpatched DDP: what the second call raises."""
    ddp.disable_forward_pre_hook(param_sync=False)
    try:
        ddp.disable_forward_pre_hook(param_sync=False)
    except Exception as exc:  # noqa: BLE001 - the crash is the measurement
        return type(exc).__name__  # (its message is a whole module repr)
    finally:
        ddp.enable_forward_pre_hook()
    return None


def _overhead_row(case: str, bare: float, patched: float) -> dict:
    """A timing row; a negative difference is below the timing noise, not a speed-up."""
    overhead = patched - bare
    if overhead < 0:
        return {"case": case, "unpatched_us": bare, "patched_us": patched, "overhead_us": None,
                "note": "difference below timing noise"}
    return {"case": case, "unpatched_us": bare, "patched_us": patched, "overhead_us": overhead, "note": ""}


def run(quick: bool = False, out_dir: str | None = None) -> list[dict]:
    """Print the table of per-call times (and write reentrant.csv / reentrant.png into `out_dir`)."""
    hide_import_notes()
    calls = 200 if quick else 2000
    rows = _guard_rows(calls) + _hook_rows(max(calls // 20, 10))
    columns = ["case", "unpatched_us", "patched_us", "overhead_us", "note"]
    title = outputs.titled("re-entrant patches: wrapper cost per call (µs; CPU, fp32 tiny GPT in megatron-core DDP)",
                          quick)
    outputs.print_table(rows, columns, title=title)
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        outputs.write_csv(rows, os.path.join(out_dir, "reentrant.csv"), columns)
        plot(rows, os.path.join(out_dir, "reentrant.png"), title)
    return rows


def plot(rows: list[dict], path: str, title: str = "re-entrant patches") -> str | None:
    """reentrant.png from the table's rows: a time the unpatched call cannot have (it crashes) is
    labelled so, not left out."""
    plotted = [
        {"case": row["case"].split(" (")[0], "variant": variant, "us": row[f"{variant}_us"]}
        for row in rows
        for variant in ("unpatched", "patched")
    ]
    return outputs.plot_grouped_bars(plotted, path, group="case", series="variant", values=["us"],
                                    titles=["µs per call"], suptitle=title, missing_label="crashes")
