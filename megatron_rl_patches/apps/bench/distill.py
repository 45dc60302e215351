"""Full-vocabulary distillation: memory and time of one student step (forward + backward down to its
hidden states and output weight) against one or two teachers, per divergence, on two routes:

- dense: every model's [T, V] logits materialized (``hidden @ W.T``; the teachers' under no_grad)
  and plain autograd through log_softmax (:func:`megatron_rl_patches.testing.divergence_reference.
  dense_divergence`);
- ours: :func:`megatron_rl_patches.lm_head_divergence` from the hidden states (no logits).

Each case runs once in a fresh process (CPU, 1 thread, fp32). Memory: the resident high-water mark
minus the gradients every route must produce (dW_s V·H and dh_s T·H), the *excess* peak in
U = T·V·4 bytes; time: the same single step, and ours over the dense route's.
"""
# lazy imports: import cost: torch and megatron-core load when a benchmark runs (in its case workers mostly)
from __future__ import annotations

import os
import time

from megatron_rl_patches.apps.bench import measure, outputs, runner

QUICK = {"tokens": [256], "vocab": 2048, "hidden": 64}
FULL = {"tokens": [1024, 4096], "vocab": 32000, "hidden": 1024}
IMPLS = (("dense (logits)", "dense"), ("ours (lm_head_divergence)", "ours"))


def short(divergence: str) -> str:
    """The plot's group label: the initials of a divergence's words, its last word whole (fkl, sfkl, tv)."""
    *words, last = divergence.split("_")
    return "".join(word[0] for word in words) + last
COLUMNS = ("T", "teachers", "divergence", "implementation", "excess_peak_U", "excess_peak_MiB", "time_s",
           "time_vs_dense", "note")


def _inputs(T: int, V: int, H: int, teachers: int):
    import torch

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(T, H, generator=g).requires_grad_()
    weight = (torch.randn(V, H, generator=g) * H**-0.5 * 2).requires_grad_()
    models = [(torch.randn(T, H, generator=g), weight.detach() + torch.randn(V, H, generator=g) * H**-0.5)
              for _ in range(teachers)]
    return hidden, weight, models


def case(probe: measure.MemoryProbe, *, impl: str, divergence: str, teachers: int, T: int, V: int, H: int,
         device: str = "cpu") -> dict:
    """One student step on one route; runs in a fresh worker process."""
    import torch

    hidden, weight, models = _inputs(T, V, H, teachers)
    mix = [1.0 / teachers] * teachers
    probe.start()
    started = time.perf_counter()
    if impl == "dense":
        from megatron_rl_patches.testing.divergence_reference import dense_divergence

        logits = hidden @ weight.T
        with torch.no_grad():
            teacher_logits = [th @ tw.T for th, tw in models]
        loss = dense_divergence(logits, teacher_logits, divergence=divergence, teacher_weights=mix).sum()
        del logits, teacher_logits
    else:
        from megatron_rl_patches.ops.divergence import lm_head_divergence

        loss = lm_head_divergence(hidden, weight, [m[0] for m in models], [m[1] for m in models],
                                  divergence=divergence, teacher_weights=mix).sum()
    loss.backward()
    seconds = time.perf_counter() - started
    peak = probe.peak()
    unavoidable = hidden.grad.nbytes + weight.grad.nbytes
    return {"excess_bytes": peak - unavoidable, "time_s": seconds, "peak_reset": probe.peak_reset, "device": device}


def _rows(plan: dict, isolate: bool) -> list[dict]:
    """One row per (T, teachers, divergence, route); every case in a fresh process when `isolate`
    (quick runs share one: figures below the memory resolution anyway)."""
    from megatron_rl_patches.ops._divergences import DIVERGENCES  # every row of the table

    V, H = plan["vocab"], plan["hidden"]
    rows = [{"T": T, "V": V, "H": H, "teachers": teachers, "divergence": divergence, "implementation": label,
             "impl": impl, "note": ""}
            for T in plan["tokens"] for teachers in (1, 2) for divergence in DIVERGENCES for label, impl in IMPLS]
    cases = [{"target": "megatron_rl_patches.apps.bench.distill:case",
              "kwargs": {key: row[key] for key in ("impl", "divergence", "teachers", "T", "V", "H")}} for row in rows]
    for row, result in zip(rows, runner.run_cases(cases, isolate=isolate)):
        unit = row["T"] * V * 4
        if "error" in result:
            row.update(note=f"error: {result['error']}"[:200], error=result["error"])
            continue
        row["time_s"] = result["time_s"]
        if measure.memory_resolved(unit, result["device"]):
            excess = result["excess_bytes"]
            row.update(excess_peak_U=excess / unit, excess_peak_MiB=excess / measure.MIB)
        else:
            row["note"] = measure.BELOW_RESOLUTION
        if not result["peak_reset"]:
            row["note"] = "peak = process lifetime peak"
    for dense, ours in zip(rows[0::2], rows[1::2]):
        if "time_s" in dense and "time_s" in ours:
            ours["time_vs_dense"] = ours["time_s"] / dense["time_s"]
    return rows


def run(quick: bool = False, out_dir: str | None = None) -> list[dict]:
    """The table (CSV, markdown and PNG into `out_dir` when given)."""
    plan = QUICK if quick else FULL
    saved_threshold = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # workers inherit it: freed [T, V] blocks leave the RSS
    try:
        rows = _rows(plan, isolate=not quick)
    finally:
        if saved_threshold is None:
            os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
        else:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = saved_threshold
    title = (f"full-vocabulary distillation step, CPU 1 thread, fp32, V={plan['vocab']}, H={plan['hidden']} "
             f"(U = T·V·4)" + (" [quick]" if quick else ""))
    outputs.print_table(rows, COLUMNS, title=title)
    if out_dir:
        outputs.write_tables(rows, COLUMNS, out_dir, "distill")
        largest = max(plan["tokens"])  # one T in the plot: 12 groups stay readable
        measured = [dict(r, case=f"{short(r['divergence'])}\n{r['teachers']}t") for r in rows
                    if "time_s" in r and r["T"] == largest]
        if measured:
            outputs.plot_grouped_bars(
                measured, os.path.join(out_dir, "distill.png"), group="case", series="implementation",
                values=["time_s"] + (["excess_peak_U"] if "excess_peak_U" in measured[0] else []),
                titles=["fwd+bwd time (s)"] + (["excess peak memory (U)"] if "excess_peak_U" in measured[0] else []),
                suptitle=f"full-vocabulary divergences from hidden states (T={largest}, V={plan['vocab']}, "
                         f"H={plan['hidden']}, CPU 1 thread, fp32; 1t/2t: teachers)",
            )
    return rows
