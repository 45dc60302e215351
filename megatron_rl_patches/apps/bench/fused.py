"""The fused LM head against the logits paths: memory and time of log-prob + entropy (both with
gradients) from hidden states [T, H] and an output weight [V, H], and of a top-k OPD step with
one or two teachers.

Three implementations side by side, each case in a fresh process (median of `runs`):
naive autograd on ``hidden @ W.T``; the logits path (``log_probs_and_entropy`` on ``hidden @ W.T``,
``inplace_backward=False``); ours (``lm_head_log_probs_and_entropy``: no logits at all).
Memory is the process's resident high-water mark (CPU; glibc told to return large blocks at
once with MALLOC_MMAP_THRESHOLD_) or the CUDA allocator's peak, minus the gradients every
implementation must produce (grad_weight V·H and grad_hidden T·H): the *excess* peak, in
U = T·V·4 bytes. Time: forward + backward down to hidden and weight, best of a few runs.
The OPD step (one run per case) reports the same excess, the bytes of the largest teacher [T, V]
logits tensor and the step's time. `run(only="logprob" | "opd" | "invariant")` runs one part;
"invariant" times ours (fused) in the default and the invariant mode at V = 151,936.
"""
# lazy imports: import cost: torch and megatron-core load when a benchmark runs (in its case workers mostly)
from __future__ import annotations

import os
import statistics
import time
from typing import Any

from megatron_rl_patches.apps.bench import measure, outputs, runner
from megatron_rl_patches.apps.presentation import dict_cells, markdown_table

QUICK = {"shapes": [(256, 2048)], "hidden": 64, "runs": 1}
FULL = {"shapes": [(1024, 32000), (4096, 32000), (16384, 32000)], "hidden": 1024, "runs": 3}
# At the largest shape only the fused op and the logits path run (naive needs ~4.8 U = 9.4 GiB and
# minutes per run on one thread; its ratio is already clear at the smaller shapes).
SKIP_NAIVE_FROM_T = 16384
IMPLS = (("naive autograd", "naive"), ("logits path", "logits"), ("ours (fused)", "fused"))
# An implementation is left out where its expected peak (in U, measured at small shapes) would
# not fit in this much memory.
EXPECTED_PEAK_U = {"naive": 4.8, "logits": 1.8, "fused": 0.3, "fused_invariant": 0.3}
MEMORY_BUDGET = 14 << 30
COLUMNS = ("shape", "implementation", "excess_peak_U", "excess_peak_MiB", "time_s", "time_vs_logits", "note")
OPD_COLUMNS = ("shape", "teachers", "implementation", "teacher_logits_MiB", "excess_peak_U", "excess_peak_MiB",
               "time_s", "time_vs_logits", "note")
# The two parts `run(only=...)` (CLI: `bench fused --only PART`) can be limited to.
PARTS = ("logprob", "opd", "invariant")
# the invariant part: ours in both modes at a Qwen-sized vocabulary
INVARIANT = {"shapes": [(4096, 151936), (16384, 151936)], "hidden": 256, "runs": 1}  # H = 256: minutes on a CPU
QUICK_INVARIANT = {"shapes": [(256, 2048)], "hidden": 64, "runs": 1}
INVARIANT_IMPLS = (("ours (fused)", "fused"), ("ours (fused), invariant", "fused_invariant"))
TOPK = 16


def head_inputs(T: int, V: int, H: int, device: str, seed: int = 0):
    """Seeded fused-head bench inputs: (hidden [T, H], weight [V, H], tokens, a, b)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g).to(device).requires_grad_()
    weight = (torch.randn(V, H, generator=g) * H**-0.5 * 2).to(device).requires_grad_()
    tokens = torch.randint(0, V, (T,), generator=g).to(device)
    a, b = torch.randn(T, generator=g).to(device), torch.randn(T, generator=g).to(device) * 0.1
    return hidden, weight, tokens, a, b


def _loss(impl: str, hidden, weight, tokens, a, b):
    import torch

    if impl == "naive":
        logp_all = torch.log_softmax(hidden @ weight.T, dim=-1)
        logp = logp_all.gather(1, tokens[:, None]).squeeze(1)
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    elif impl == "logits":
        from megatron_rl_patches.ops.logprobs import log_probs_and_entropy

        logp, entropy = log_probs_and_entropy(hidden @ weight.T, tokens, with_entropy=True)
    else:
        from megatron_rl_patches.ops.lm_head import lm_head_log_probs_and_entropy

        logp, entropy = lm_head_log_probs_and_entropy(hidden, weight, tokens, with_entropy=True,
                                                      invariant=impl == "fused_invariant")
    return (a * logp).sum() + (b * entropy).sum()


def logprob_case(probe: measure.MemoryProbe, *, impl: str, T: int, V: int, H: int, repeat: int = 3,
                 device: str = "cpu") -> dict:
    """One (implementation, shape): excess peak and time; runs in a fresh worker process."""
    import torch

    hidden, weight, tokens, a, b = head_inputs(T, V, H, device)
    probe.start()
    _loss(impl, hidden, weight, tokens, a, b).backward()
    peak = probe.peak()
    unavoidable = hidden.grad.nbytes + weight.grad.nbytes

    def step(_: Any = None) -> None:
        hidden.grad = weight.grad = None
        _loss(impl, hidden, weight, tokens, a, b).backward()

    sync = torch.cuda.synchronize if probe.cuda else None
    seconds = measure.best_time(step, repeat=repeat, warmup=0, sync=sync)
    return {"excess_bytes": peak - unavoidable, "time_s": seconds, "peak_reset": probe.peak_reset, "device": device}


def opd_case(probe: measure.MemoryProbe, *, impl: str, teachers: int, T: int, V: int, H: int,
             device: str = "cpu") -> dict:
    """A top-k OPD step: teachers score the student's top-k ids (no grad), the student's loss
    backpropagates to its hidden states and weight. `impl`: "logits" (today's ops on [T, V]
    logits) or "fused" (everything from hidden states)."""
    import torch

    from megatron_rl_patches.ops.topk import topk_ids, topk_kl, topk_logprobs, topk_opd_loss

    hidden, weight, _, _, _ = head_inputs(T, V, H, device)
    g = torch.Generator().manual_seed(1)
    teacher_weights = [(weight.detach() + 0.2 * torch.randn(V, H, generator=g).to(device) * H**-0.5)
                       for _ in range(teachers)]
    teacher_hidden = hidden.detach()
    probe.start()
    started = time.perf_counter()
    teacher_bytes = 0
    if impl == "logits":
        logits = hidden @ weight.T
        ids = topk_ids(logits.detach(), TOPK)
        buckets = []
        with torch.no_grad():
            for w in teacher_weights:
                teacher_logits = teacher_hidden @ w.T
                teacher_bytes = max(teacher_bytes, teacher_logits.nbytes)
                buckets.append(topk_logprobs(teacher_logits, ids))
                del teacher_logits
        teacher_lp = torch.stack([lp for lp, _ in buckets])
        teacher_tail = torch.stack([tail for _, tail in buckets])
        loss = topk_opd_loss(logits, ids, teacher_lp, teacher_tail).sum()
        del logits
    else:
        from megatron_rl_patches.ops.lm_head import lm_head_topk_ids, lm_head_topk_logprobs

        with torch.no_grad():
            ids = lm_head_topk_ids(hidden.detach(), weight.detach(), TOPK)
            buckets = [lm_head_topk_logprobs(teacher_hidden, w, ids) for w in teacher_weights]
        teacher_lp = torch.stack([lp for lp, _ in buckets])
        teacher_tail = torch.stack([tail for _, tail in buckets])
        student_lp, student_tail = lm_head_topk_logprobs(hidden, weight, ids)
        loss = topk_kl(student_lp, student_tail, teacher_lp, teacher_tail).sum()
    loss.backward()
    if probe.cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    peak = probe.peak()
    unavoidable = hidden.grad.nbytes + weight.grad.nbytes
    return {"excess_bytes": peak - unavoidable, "teacher_logits_bytes": teacher_bytes, "time_s": seconds,
            "peak_reset": probe.peak_reset, "device": device}


def _median_runs(target: str, kwargs: dict, runs: int) -> dict:
    results = runner.run_cases([{"target": target, "kwargs": kwargs}] * runs, isolate=True, threads=1)
    good = [r for r in results if "error" not in r]
    if not good:
        return results[0]
    merged = {key: statistics.median(r[key] for r in good) for key in good[0] if key != "peak_reset"}
    merged["peak_reset"] = all(r.get("peak_reset", True) for r in good)
    return merged


def _fits(impl: str, T: int, V: int, H: int) -> bool:
    return EXPECTED_PEAK_U[impl] * T * V * 4 + 2 * (V + T) * H * 4 < MEMORY_BUDGET


def run(quick: bool = False, out_dir: str | None = None, only: str | None = None) -> list[dict]:
    """Both tables (or the one part named by `only`, one of PARTS); CSV, markdown and PNG into
    `out_dir` when given."""
    if only is not None and only not in PARTS:
        raise ValueError(f"only must be one of {PARTS} or None (both parts), got {only!r}")
    plan = QUICK if quick else FULL
    H, runs = plan["hidden"], plan["runs"]
    saved_threshold = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # workers inherit it: freed [T, V] blocks leave the RSS
    try:
        rows = _logprob_rows(plan["shapes"], H, runs) if only in (None, "logprob") else []
        if only == "invariant":
            inv = QUICK_INVARIANT if quick else INVARIANT
            H = inv["hidden"]
            rows = _logprob_rows(inv["shapes"], H, inv["runs"], INVARIANT_IMPLS)
        opd_shapes = plan["shapes"][:2] if not quick else plan["shapes"]
        opd_rows = _opd_rows(opd_shapes, H) if only in (None, "opd") else []
    finally:
        if saved_threshold is None:
            os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
        else:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = saved_threshold
    title = f"fused LM head: log-prob + entropy with grads, CPU 1 thread, fp32, H={H} (U = T·V·4)"
    tables = [(rows, COLUMNS, "fused", title + (" [quick]" if quick else "")),
              (opd_rows, OPD_COLUMNS, "fused_opd", f"top-k OPD step (k={TOPK}): teachers + student, H={H}")]
    tables = [table for table in tables if table[0]]
    for table_rows, columns, _, table_title in tables:
        outputs.print_table(table_rows, columns, title=table_title)
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        for table_rows, _, name, _ in tables:
            outputs.write_csv(table_rows, os.path.join(out_dir, f"{name}.csv"))
        with open(os.path.join(out_dir, "fused.md"), "w") as fh:
            fh.write("\n\n".join(markdown_table(columns, dict_cells(table_rows, columns))
                                  for table_rows, columns, _, _ in tables) + "\n")
        measured = [r for r in rows if "time_s" in r]
        if measured:
            outputs.plot_grouped_bars(
                measured, os.path.join(out_dir, "fused.png"), group="shape", series="implementation",
                values=["excess_peak_U", "time_s"], titles=["excess peak memory (U)", "fwd+bwd time (s)"],
                suptitle=outputs.titled(f"log-prob + entropy from hidden states (CPU, 1 thread, fp32, H={H})", quick),
            )
    return rows + opd_rows


def _ratios_to_logits_path(rows: list[dict], same_case, base: str = "logits path") -> None:
    """time_vs_logits on every timed row: its time over the `base` implementation's in the same case."""
    for row in rows:
        logits = next((r for r in rows if same_case(r, row) and r["implementation"] == base), {})
        if "time_s" in row and "time_s" in logits:
            row["time_vs_logits"] = row["time_s"] / logits["time_s"]


def _logprob_rows(shapes, H: int, runs: int, impls=IMPLS) -> list[dict]:
    rows = []
    for T, V in shapes:
        unit = T * V * 4
        for label, impl in impls:
            row: dict[str, Any] = {"shape": f"{T}x{V}", "T": T, "V": V, "H": H, "implementation": label, "note": ""}
            if impl == "naive" and T >= SKIP_NAIVE_FROM_T:
                row["note"] = "left out at this size (see the smaller shapes)"
                rows.append(row)
                continue
            if not _fits(impl, T, V, H):
                row["note"] = f"left out: needs ~{EXPECTED_PEAK_U[impl] * unit / (1 << 30):.0f} GiB"
                rows.append(row)
                continue
            result = _median_runs("megatron_rl_patches.apps.bench.fused:logprob_case",
                                  dict(impl=impl, T=T, V=V, H=H, repeat=1 if runs == 1 else 2), runs)
            if "error" in result:
                row["note"] = f"error: {result['error']}"[:200]
            else:
                row["time_s"] = result["time_s"]
                if not measure.memory_resolved(unit, result["device"]):
                    row["note"] = measure.BELOW_RESOLUTION
                else:
                    row.update(excess_peak_U=result["excess_bytes"] / unit,
                               excess_peak_MiB=result["excess_bytes"] / measure.MIB)
                if not result["peak_reset"]:
                    row["note"] = "peak = process lifetime peak"
            rows.append(row)
    _ratios_to_logits_path(rows, lambda a, b: a["shape"] == b["shape"],
                           "ours (fused)" if impls is INVARIANT_IMPLS else "logits path")
    return rows


def _opd_rows(shapes, H: int) -> list[dict]:
    rows = []
    for T, V in shapes:
        for teachers in (1, 2):
            for label, impl in (("logits path", "logits"), ("ours (fused)", "fused")):
                row: dict[str, Any] = {"shape": f"{T}x{V}", "teachers": teachers, "implementation": label, "note": ""}
                result = runner.run_cases([{"target": "megatron_rl_patches.apps.bench.fused:opd_case",
                                            "kwargs": dict(impl=impl, teachers=teachers, T=T, V=V, H=H)}])[0]
                if "error" in result:
                    row["note"] = f"error: {result['error']}"[:200]
                else:
                    row["teacher_logits_MiB"] = result["teacher_logits_bytes"] / measure.MIB
                    row["time_s"] = result["time_s"]
                    if not measure.memory_resolved(T * V * 4, result["device"]):
                        row["note"] = measure.BELOW_RESOLUTION
                    else:
                        row.update(excess_peak_U=result["excess_bytes"] / (T * V * 4),
                                   excess_peak_MiB=result["excess_bytes"] / measure.MIB)
                    if not result["peak_reset"]:
                        row["note"] = "peak = process lifetime peak"
                rows.append(row)
    _ratios_to_logits_path(rows, lambda a, b: (a["shape"], a["teachers"]) == (b["shape"], b["teachers"]))
    return rows
