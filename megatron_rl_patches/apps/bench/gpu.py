"""`bench gpu`: log-prob + entropy with gradients from hidden states on one CUDA device, every
implementation side by side: naive autograd, the logits path (matmul + our logits op), ours on
the torch tiles, on the Triton kernels and on the vendor GEMM + Triton row pass (``gemm``), ours in
the invariant mode (the Triton kernel, the torch tiles), verl's Triton kernel and Liger-Kernel's
fused linear cross-entropy where importable (else a line saying why not), and top-k (k = 64) ids +
log-probs + tail.

A tool, not a report: per token count the one GEMM ``[T, H] × [H, V]`` is timed first, then each
implementation's line is printed (flushed) as soon as its runs end: forward, backward and a
no-grad forward apart, each as a ratio to that GEMM (the no-grad forward against one GEMM, forward
+ backward against four: docs/benchmarks.md). Slow rows (the torch tiles at the largest T) run
only with ``--slow``.

bf16 inputs, TP = 1. Memory: the CUDA allocator's peak during forward + backward minus what was
allocated before, minus the gradients every implementation must produce (dW + dh): the *excess*
peak, in U = T·V·4 bytes and GiB. Time: the median of the runs. A case that runs out of memory is
recorded as "OOM" and the run goes on.
"""
# lazy imports: import cost: `bench` imports this module to parse its arguments, before torch (test_light_usage_errors)
from __future__ import annotations

import gc
import importlib
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from megatron_rl_patches.apps.bench import measure, outputs
from megatron_rl_patches.apps.presentation import dict_cells, markdown_table

GIB = 1 << 30
FULL = {"tokens": (4096, 16384, 65536), "hidden": 4096, "vocab": 151936, "runs": 5}
# the quick run: one token count at the full width (under a minute on an H100, compiles included)
QUICK = {"tokens": (4096,), "hidden": 4096, "vocab": 151936, "runs": 2}
TOPK = 64
COLUMNS = ("T", "implementation", "time_ms", "fwd_ms", "bwd_ms", "nograd_ms", "nograd_vs_gemm", "total_vs_4gemm",
           "time_vs_logits", "excess_peak_U", "excess_peak_GiB", "note")
GEMM = "one GEMM [T,H]x[H,V]"
# rows that take minutes at the largest token count: run only with --slow
SLOW = ("ours, torch tiles", "ours, invariant, torch tiles", "top-k 64 ids + log-probs + tail, torch tiles")
SKIPPED_SLOW = "skipped: slow at this T (--slow runs it)"
OOM = "OOM"
NOT_INSTALLED = "not installed"
INVARIANT_TRITON = "ours, invariant, Triton kernel"
INVARIANT_TILES = "ours, invariant, torch tiles"


def cuda_missing() -> str | None:
    """Why this machine cannot run `bench gpu` (one line), or None."""
    try:
        import torch
    except ImportError:
        return "needs torch with CUDA; torch is not installed"
    if not torch.cuda.is_available():
        return f"needs a CUDA device; torch {torch.__version__} sees none (CUDA build: {torch.version.cuda or 'no'})"
    return None


# ----------------------------------------------------------------------------- implementations


@dataclass(frozen=True)
class Inputs:
    hidden: Any
    weight: Any
    tokens: Any
    grad_lp: Any
    grad_ent: Any


def make_inputs(T: int, H: int, V: int, device: str, dtype: Any) -> Inputs:
    import torch

    g = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(T, H, device=device, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(V, H, device=device, generator=g) * H**-0.5 * 2).to(dtype).requires_grad_()
    tokens = torch.randint(0, V, (T,), device=device, generator=g)
    return Inputs(hidden, weight, tokens, torch.randn(T, device=device, generator=g),
                  torch.randn(T, device=device, generator=g) * 0.1)


def _naive(x: Inputs):
    import torch

    logp_all = torch.log_softmax((x.hidden @ x.weight.T).float(), dim=-1)
    lp = logp_all.gather(1, x.tokens[:, None]).squeeze(1)
    return lp, -(logp_all.exp() * logp_all).sum(-1)


def _logits_path(x: Inputs):
    from megatron_rl_patches.ops.logprobs import log_probs_and_entropy

    return log_probs_and_entropy((x.hidden @ x.weight.T).float(), x.tokens, with_entropy=True)


def _ours(backend: str, invariant: bool = False) -> Callable[[Inputs], Any]:
    def run(x: Inputs):
        from megatron_rl_patches.ops.lm_head import lm_head_log_probs_and_entropy

        return lm_head_log_probs_and_entropy(x.hidden, x.weight, x.tokens, with_entropy=True, backend=backend,
                                             invariant=invariant)

    return run


def _ours_topk(backend: str) -> Callable[[Inputs], Any]:
    def run(x: Inputs):
        import torch

        from megatron_rl_patches.ops.lm_head import lm_head_topk_ids, lm_head_topk_logprobs

        with torch.no_grad():  # the ids on the row's backend too (auto would take Triton's on CUDA)
            ids = lm_head_topk_ids(x.hidden, x.weight, TOPK, backend=backend)
        lp, tail = lm_head_topk_logprobs(x.hidden, x.weight, ids, backend=backend)
        return lp.mean(1), tail  # weighted like log-prob and entropy by the driver

    return run


def _verl(x: Inputs):
    from verl.utils.kernel.linear_cross_entropy import linear_cross_entropy  # lazy: optional dependency verl

    lp, ent = linear_cross_entropy(x.hidden, x.weight, x.tokens, 1.0, "none")
    return lp, ent


def _liger(x: Inputs):
    # lazy: optional dependency liger-kernel
    from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

    # Liger returns the reduced loss -Σ log p only (no per-token values, no entropy)
    loss = LigerFusedLinearCrossEntropyFunction.apply(x.hidden, x.weight, x.tokens, None, None, -100, 0.0, 0.0, "sum")
    loss = loss[0] if isinstance(loss, tuple) else loss
    return -loss, None


def implementations() -> list[tuple[str, Callable[[Inputs], Any], str | None]]:
    """(label, function, module that must import or None) for every row of a token count."""
    return [
        ("naive autograd", _naive, None),
        ("logits path", _logits_path, None),
        ("ours, torch tiles", _ours("torch"), None),
        ("ours, triton", _ours("triton"), "triton"),
        ("ours, gemm", _ours("gemm"), "triton"),
        # the invariant mode (docs/train-rollout-agreement.md): Triton's kernel, and the torch tiles
        (INVARIANT_TRITON, _ours("triton", invariant=True), "triton"),
        (INVARIANT_TILES, _ours("torch", invariant=True), None),
        ("verl triton kernel", _verl, "verl.utils.kernel.linear_cross_entropy"),
        ("liger fused linear CE (log-prob only)", _liger, "liger_kernel.ops.fused_linear_cross_entropy"),
        (f"top-k {TOPK} ids + log-probs + tail, torch tiles", _ours_topk("torch"), None),
        (f"top-k {TOPK} ids + log-probs + tail, triton", _ours_topk("triton"), "triton"),
        (f"top-k {TOPK} ids + log-probs + tail, gemm", _ours_topk("gemm"), "triton"),
    ]


# ----------------------------------------------------------------------------- measuring


def import_problem(module: str | None) -> str | None:
    """Why `module` cannot be used here (one line), or None."""
    if module is None:
        return None
    try:
        importlib.import_module(module)
    except Exception as exc:  # ImportError, or a package broken against this torch: either way not usable
        return f"{type(exc).__name__}: {exc}"[:160]
    return None


def importable(module: str | None) -> bool:
    return import_problem(module) is None


def is_oom(exc: BaseException) -> bool:
    import torch

    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower()


def measure_once(fn: Callable[[Inputs], Any], x: Inputs, probe: measure.MemoryProbe, sync: Callable[[], None],
                 clock: Callable[[], float]) -> dict:
    """One forward + backward, then one no-grad forward: {"time_s", "fwd_s", "bwd_s", "nograd_s",
    "excess_bytes"} (the excess of the forward + backward) or {"oom": True} or {"error": text}."""
    import torch

    x.hidden.grad = x.weight.grad = None
    if probe.cuda:  # a measured peak needs the last run freed first (on CPU no peak is measured)
        gc.collect()
    probe.start()
    try:
        sync()
        started = clock()
        lp, ent = fn(x)
        loss = (lp * x.grad_lp).sum() + ((ent * x.grad_ent).sum() if ent is not None else 0.0)
        sync()
        forward_done = clock()
        loss.backward()
        sync()
        ended = clock()
        unavoidable = sum(t.grad.nbytes for t in (x.hidden, x.weight) if t.grad is not None)
        excess = probe.peak() - unavoidable if probe.cuda else None
        del lp, ent, loss
        x.hidden.grad = x.weight.grad = None
        with torch.no_grad():
            sync()
            nograd_started = clock()
            fn(x)
            sync()
            nograd_s = clock() - nograd_started
    except Exception as exc:  # OOM is a result; anything else is reported in the row
        x.hidden.grad = x.weight.grad = None
        if is_oom(exc):
            return {"oom": True}
        return {"error": f"{type(exc).__name__}: {exc}"[:200]}
    return {"time_s": ended - started, "fwd_s": forward_done - started, "bwd_s": ended - forward_done,
            "nograd_s": nograd_s, "excess_bytes": excess}


def measure_gemm(x: Inputs, sync: Callable[[], None], clock: Callable[[], float], runs: int) -> dict:
    """The one GEMM of the head, ``hidden @ weightᵀ`` in the inputs' dtype: the yardstick."""
    import torch

    times = []
    with torch.no_grad():
        for _ in range(runs + 1):  # the first warms cuBLAS up
            sync()
            started = clock()
            torch.mm(x.hidden, x.weight.t())
            sync()
            times.append(clock() - started)
    return {"time_s": statistics.median(times[1:])}


def summarize(T: int, V: int, label: str, results: list[dict], skip_note: str | None = None) -> dict:
    """One table row from the runs of one implementation at one token count."""
    row: dict[str, Any] = {"T": T, "implementation": label, "note": skip_note or ""}
    if skip_note is not None:
        return row
    if any(r.get("oom") for r in results):
        row["note"] = OOM
        return row
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        row["note"] = f"error: {errors[0]}"
        return row
    row["time_ms"] = statistics.median(r["time_s"] for r in results) * 1e3
    for phase in ("fwd", "bwd", "nograd"):
        if all(f"{phase}_s" in r for r in results):
            row[f"{phase}_ms"] = statistics.median(r[f"{phase}_s"] for r in results) * 1e3
    excess = [r["excess_bytes"] for r in results if r.get("excess_bytes") is not None]
    if excess:
        peak = max(excess)
        row.update(excess_peak_U=peak / (T * V * 4), excess_peak_GiB=peak / GIB)
    return row


def with_gemm_ratios(row: dict, gemm_ms: float | None) -> dict:
    """nograd_vs_gemm (the no-grad forward over one GEMM) and total_vs_4gemm (forward + backward
    over four GEMMs: the floor with a per-token upstream gradient)."""
    if gemm_ms:
        if "nograd_ms" in row:
            row["nograd_vs_gemm"] = row["nograd_ms"] / gemm_ms
        if "time_ms" in row and row["implementation"] != GEMM:
            row["total_vs_4gemm"] = row["time_ms"] / (4 * gemm_ms)
    return row


def with_ratios(rows: list[dict]) -> list[dict]:
    """time_vs_logits: each timed row's median time over the logits path's at the same T."""
    for row in rows:
        base = next((r for r in rows if r["T"] == row["T"] and r["implementation"] == "logits path"), {})
        if "time_ms" in row and "time_ms" in base:
            row["time_vs_logits"] = row["time_ms"] / base["time_ms"]
    return rows


def line(row: dict) -> str:
    """One case's line as it ends: the times, their ratios to the GEMM, the excess, the note."""
    parts = [f"T={row['T']:>6}", f"{row['implementation']:<46}"]
    for key, text in (("time_ms", "fwd+bwd {:.1f} ms"), ("fwd_ms", "fwd {:.1f}"), ("bwd_ms", "bwd {:.1f}"),
                      ("nograd_ms", "no-grad fwd {:.1f} ms"), ("nograd_vs_gemm", "{:.2f}x GEMM"),
                      ("total_vs_4gemm", "fwd+bwd {:.2f}x 4 GEMMs"), ("excess_peak_U", "excess {:.3f} U")):
        if row.get(key) is not None:
            parts.append(text.format(row[key]))
    if row.get("note"):
        parts.append(str(row["note"]))
    return "  ".join(parts)


def run_token_count(T: int, H: int, V: int, runs: int, device: str, dtype: Any,
                    impls: list[tuple[str, Callable[[Inputs], Any], str | None]],
                    emit: Callable[[dict], None] = lambda row: None, slow: bool = True,
                    clock: Callable[[], float] = time.perf_counter) -> list[dict]:
    """The GEMM, then every implementation at one T (one warm-up, then `runs` runs), each row
    handed to `emit` as soon as it ends. `slow` False: the SLOW rows are skipped (a line says so)."""
    import torch

    cuda = device.startswith("cuda")
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    probe = measure.MemoryProbe(device)
    try:
        x = make_inputs(T, H, V, device, dtype)
    except Exception as exc:
        if not is_oom(exc):
            raise
        rows = [summarize(T, V, label, [{"oom": True}]) for label, _, _ in impls]
        for row in rows:
            emit(row)
        return rows
    gemm = summarize(T, V, GEMM, [measure_gemm(x, sync, clock, runs)])
    emit(gemm)
    rows = [gemm]
    for label, fn, module in impls:
        problem = import_problem(module)
        if problem is not None:
            row = summarize(T, V, label, [], NOT_INSTALLED)
            emit(dict(row, note=f"{NOT_INSTALLED}: {problem}"))
        elif not slow and label in SLOW:
            row = summarize(T, V, label, [], SKIPPED_SLOW)
            emit(row)
        else:
            results = [measure_once(fn, x, probe, sync, clock)]  # warm-up (compiles kernels)
            _free(cuda)
            if "oom" not in results[0] and "error" not in results[0]:
                results = []
                for _ in range(runs):
                    results.append(measure_once(fn, x, probe, sync, clock))
                    _free(cuda)
            row = with_gemm_ratios(summarize(T, V, label, results), gemm["time_ms"])
            emit(row)
        rows.append(row)
    del x
    _free(cuda)
    return rows


def _free(cuda: bool) -> None:
    """Free the last run's memory before the next is measured: CUDA only (no peak is measured on CPU)."""
    if cuda:
        import torch

        gc.collect()
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- outputs


def write_outputs(rows: list[dict], out_dir: str, title: str) -> list[str]:
    """gpu.csv, gpu.md (title + markdown table) and gpu.png (when matplotlib imports)."""
    os.makedirs(out_dir, exist_ok=True)
    paths = [outputs.write_csv(rows, os.path.join(out_dir, "gpu.csv"), COLUMNS)]
    md = os.path.join(out_dir, "gpu.md")
    with open(md, "w") as fh:
        fh.write(f"{title}\n\n{markdown_table(COLUMNS, dict_cells(rows, COLUMNS))}\n")
    paths.append(md)
    timed = [dict(r, T=str(r["T"])) for r in rows if "time_ms" in r]
    if timed:
        png = outputs.plot_grouped_bars(timed, os.path.join(out_dir, "gpu.png"), group="T", series="implementation",
                                       values=["time_ms", "excess_peak_U"],
                                       titles=["fwd+bwd time (ms, median)", "excess peak (U = T·V·4 B)"],
                                       suptitle=title)
        if png:
            paths.append(png)
    return paths


def run(quick: bool = False, out_dir: str | None = None, device: str = "cuda", slow: bool = False) -> list[dict]:
    """The table on `device` (CUDA; tests pass "cpu" with tiny shapes, memory then unmeasured),
    a line per case printed (flushed) as it ends. `slow`: also the SLOW rows at the largest T."""
    import torch

    plan = QUICK if quick else FULL
    H, V = plan["hidden"], plan["vocab"]
    name = torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu"
    title = (f"log-prob + entropy with grads from hidden states, bf16, H={H}, V={V}, TP=1, {name}, "
             f"torch {torch.__version__}" + (" [quick]" if quick else ""))
    print(title, flush=True)
    rows: list[dict] = []
    largest = max(plan["tokens"])
    for T in plan["tokens"]:
        rows += run_token_count(T, H, V, plan["runs"], device, torch.bfloat16, implementations(),
                                emit=lambda row: print(line(row), flush=True), slow=slow or T < largest)
    rows = with_ratios(rows)
    if out_dir:
        write_outputs(rows, out_dir, title)
    return rows
