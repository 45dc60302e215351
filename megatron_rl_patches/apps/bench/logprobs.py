"""Memory and time of per-token log-prob (+ entropy) losses over [T, V] logits.

Every case runs in a fresh process: an LM head (hidden @ W^T) produces the logits inside the
measured region, the caller's reference is dropped (only the loss keeps them alive), then
backward runs through the head. Reported in U = T·V·4 bytes (one fp32 copy of the logits),
logits included: ``saved`` (bytes autograd saved for backward, hooks), ``held`` (memory alive
between forward and backward), ``peak`` (over head + loss forward + backward). Time is the loss
alone: forward plus the backward down to the logits, best of a few runs.

Implementations: naive autograd; a fused Function that keeps the softmax (the idea of slime's
current one, written here as a reference); megatron-core's ``vocab_parallel_cross_entropy``
(log-prob only); ours, with and without the entropy gradient, fresh or in-place gradient, and in
the invariant mode (``invariant=True``). `run(only="invariant")` (CLI: `bench logprobs --only
invariant`) runs ours against ours invariant at a Qwen-sized vocabulary (V = 151,936).
"""
# lazy imports: import cost: torch and megatron-core load when a benchmark runs (in its case workers mostly)
from __future__ import annotations

import contextlib
import os
from typing import Any

from megatron_rl_patches.apps.bench import measure
from megatron_rl_patches.apps.bench.measure import MemoryProbe, SavedBytes, best_time
from megatron_rl_patches.apps.bench.outputs import plot_grouped_bars, print_table, titled, write_tables
from megatron_rl_patches.apps.bench.runner import run_cases

QUICK_SHAPES = [(256, 2048)]
FULL_SHAPES = [(1024, 32000), (4096, 32000)]
HIDDEN = 64
# `only="invariant"`: the default mode against the invariant mode at a Qwen-sized vocabulary
INVARIANT_SHAPES = [(4096, 151936), (16384, 151936)]
QUICK_INVARIANT_SHAPES = [(256, 2048)]
PARTS = ("invariant",)

# (label, implementation, task, in-place)
VARIANTS = [
    ("naive autograd", "naive", "grad", False),
    ("fused, softmax kept", "fused", "grad", False),
    ("ours", "ours", "grad", False),
    ("ours, in-place grad", "ours", "grad", True),
    ("ours, invariant", "ours_invariant", "grad", False),
    ("naive autograd", "naive", "metric", False),
    ("fused, softmax kept", "fused", "metric", False),
    ("megatron-core CE (log-prob only)", "mcore", "metric", False),
    ("ours", "ours", "metric", False),
    ("ours, in-place grad", "ours", "metric", True),
    ("ours, invariant", "ours_invariant", "metric", False),
]
INVARIANT_VARIANTS = [variant for variant in VARIANTS if variant[1] in ("ours", "ours_invariant") and not variant[3]]
COLUMNS = ["shape", "task", "implementation", "saved_U", "held_U", "peak_U", "time_s", "time_vs_naive",
           "peak_vs_naive", "note"]


# ------------------------------------------------------------------------ implementations


def _naive_loss(logits, tokens, a, b, task):
    import torch

    logp_all = torch.log_softmax(logits.float(), dim=-1)
    logp = logp_all.gather(1, tokens.unsqueeze(1)).squeeze(1)
    if task == "grad":
        entropy = -(logp_all.exp() * logp_all).sum(-1)
        return (a * logp).sum() + (b * entropy).sum()
    with torch.no_grad():
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    return (a * logp).sum() + 0.0 * entropy.sum()


def _fused_function():
    from megatron_rl_patches.apps.bench.slime_reference import SoftmaxKeeping

    return SoftmaxKeeping


def _make_loss(impl: str, task: str, inplace: bool):
    if impl == "naive":
        return lambda logits, tokens, a, b: _naive_loss(logits, tokens, a, b, task)
    if impl == "fused":
        fn = _fused_function()

        def fused(logits, tokens, a, b):
            logp, entropy = fn.apply(logits, tokens, task == "grad")
            return (a * logp).sum() + ((b * entropy).sum() if task == "grad" else 0.0 * entropy.detach().sum())

        return fused
    if impl == "mcore":
        # lazy: optional dependency megatron-core
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        return lambda logits, tokens, a, b: (a * -vocab_parallel_cross_entropy(logits, tokens)).sum()
    if impl in ("ours", "ours_invariant"):
        from megatron_rl_patches.ops.logprobs import log_probs_and_entropy

        def ours(logits, tokens, a, b):
            logp, entropy = log_probs_and_entropy(logits, tokens, with_entropy=True,
                                                  entropy_requires_grad=task == "grad", inplace_backward=inplace,
                                                  invariant=impl == "ours_invariant")
            return (a * logp).sum() + ((b * entropy).sum() if task == "grad" else 0.0 * entropy.sum())

        return ours
    raise ValueError(f"unknown implementation {impl!r}")


# ------------------------------------------------------------------------ one case (worker side)


def logprob_case(probe: MemoryProbe, *, impl: str, task: str, inplace: bool, T: int, V: int, hidden: int = HIDDEN,
                 repeat: int = 3, warmup: int = 1, seed: int = 0, device: str = "cpu") -> dict:
    """Measure one (implementation, task) at one shape; runs inside the bench worker process."""
    import torch

    from megatron_rl_patches.testing.megatron_cpu import megatron_world

    # megatron-core's vocab_parallel_cross_entropy reads the TP group: a world of size 1 for it.
    with megatron_world(device) if impl == "mcore" else contextlib.nullcontext():
        loss_fn = _make_loss(impl, task, inplace)
        g = torch.Generator().manual_seed(seed)
        h = torch.randn(T, hidden, generator=g).to(device).requires_grad_()
        w = (torch.randn(V, hidden, generator=g) * hidden**-0.5 * 3).to(device).requires_grad_()
        tokens = torch.randint(0, V, (T,), generator=g).to(device)
        a, b = torch.randn(T, generator=g).to(device), torch.randn(T, generator=g).to(device) * 0.1
        sync = (lambda: torch.cuda.synchronize()) if probe.cuda else None

        probe.start()
        with SavedBytes(ignore=[h, w]) as saved:
            logits = h @ w.t()
            loss = loss_fn(logits, tokens, a, b)
            del logits  # only the loss keeps the logits alive now
        held = probe.current()
        loss.backward()
        del loss
        peak = probe.peak()
        peak_reset = probe.peak_reset

        source = (h @ w.t()).detach()
        h.grad = w.grad = None

        def fresh_logits():
            # a non-leaf, not a view, like an LM head output (megatron-core writes into its input)
            return source.clone().requires_grad_() * 1.0

        def step(x):
            torch.autograd.grad(loss_fn(x, tokens, a, b), x)

        seconds = best_time(step, repeat=repeat, warmup=warmup, sync=sync, setup=fresh_logits)
    return {"saved_bytes": saved.bytes, "held_bytes": held, "peak_bytes": peak, "time_s": seconds,
            "peak_reset": peak_reset, "device": device}


# ------------------------------------------------------------------------ the benchmark


def run(quick: bool = False, out_dir: str | None = None, only: str | None = None) -> list[dict]:
    """Run the log-prob benchmark; print the table, and write CSV + PNG into `out_dir` when given.

    `quick`: one tiny shape, one timing run, all cases in one worker process (memory still per
    case: the peak mark is reset between them), megatron-core skipped (its import alone takes
    longer than the whole quick run). `only="invariant"`: ours in both modes at V = 151,936
    (time_vs_naive: against ours in the default mode).
    """
    if only is not None and only not in PARTS:
        raise ValueError(f"only must be one of {PARTS} or None (every implementation), got {only!r}")
    if only == "invariant":
        shapes, variants = (QUICK_INVARIANT_SHAPES if quick else INVARIANT_SHAPES), INVARIANT_VARIANTS
    else:
        shapes, variants = (QUICK_SHAPES if quick else FULL_SHAPES), VARIANTS
    plan, cases = [], []
    for T, V in shapes:
        for label, impl, task, inplace in variants:
            plan.append((T, V, label, impl, task, inplace))
            if impl == "mcore" and quick:
                continue
            cases.append({"target": "megatron_rl_patches.apps.bench.logprobs:logprob_case",
                          "kwargs": dict(impl=impl, task=task, inplace=inplace, T=T, V=V,
                                         repeat=1 if quick else 3, warmup=0 if quick else 1)})
    results = iter(run_cases(cases, isolate=not quick, threads=1))
    rows = []
    for T, V, label, impl, task, inplace in plan:
        unit = T * V * 4
        row: dict[str, Any] = {"shape": f"{T}x{V}", "T": T, "V": V, "task": task, "implementation": label,
                               "impl": impl, "inplace": inplace, "U_bytes": unit, "note": ""}
        if impl == "mcore" and quick:
            row["note"] = "skipped in quick mode (importing megatron-core takes ~10 s)"
        else:
            result = next(results)
            if "error" in result:
                row["note"] = f"error: {result['error']}"[:200]
            else:
                row.update(result)
                row["saved_U"] = result["saved_bytes"] / unit  # counted exactly: autograd's saved tensors
                if measure.memory_resolved(unit, result["device"]):
                    row.update(held_U=result["held_bytes"] / unit, peak_U=result["peak_bytes"] / unit)
                else:
                    row["note"] = measure.BELOW_RESOLUTION
                    row["peak_bytes"] = None
                if impl == "mcore":
                    row["note"] = "log-prob only; overwrites the logits with the softmax"
                if not result.get("peak_reset", True):
                    row["note"] = (row["note"] + "; " if row["note"] else "") + "peak = process lifetime peak"
        rows.append(row)
    for row in rows:
        naive = next((r for r in rows if r["shape"] == row["shape"] and r["task"] == row["task"]
                      and r["impl"] == ("ours" if only else "naive") and "time_s" in r), None)
        if naive and "time_s" in row:
            row["time_vs_naive"] = row["time_s"] / naive["time_s"]
            if row.get("peak_bytes") and naive.get("peak_bytes"):
                row["peak_vs_naive"] = row["peak_bytes"] / naive["peak_bytes"]
    print_table(rows, COLUMNS, title=f"log-prob + entropy losses, CPU 1 thread, fp32 (U = T·V·4 bytes)"
                                      f"{' [quick]' if quick else ''}")
    if out_dir:
        write_tables(rows, COLUMNS, out_dir, "logprobs")
        plotted = [dict(r, label=f"{r['shape']}\n{r['task']}") for r in rows if "time_s" in r]
        plot_grouped_bars(
            plotted, os.path.join(out_dir, "logprobs.png"), group="label", series="implementation",
            values=["peak_U", "held_U", "time_s"],
            titles=["peak memory (U)", "held between forward and backward (U)", "loss fwd+bwd time (s)"],
            suptitle=titled("log-prob + entropy over [T, V] logits (CPU, 1 thread, fp32)", quick),
        )
    return rows
