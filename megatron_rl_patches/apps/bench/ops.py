"""`bench ops`: today's vocabulary ops against a git revision's, side by side and interleaved.

The baseline revision's package is exported with ``git archive`` into a temporary folder; every
(op, side) run is its own process (``ops_worker.py`` with that side's package first on
PYTHONPATH), alternating today / baseline per op and repeat, so a loaded machine's noise falls on
both. Reported: per-op medians and today/baseline, log-prob + entropy against slime's Function,
and the fused head against the logits path (h·Wᵀ, the logits op, both gradient matmuls).
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap

from megatron_rl_patches.apps.bench.outputs import plot_grouped_bars, print_table
from megatron_rl_patches.apps.presentation import dict_cells, markdown_table

# ops that existed at aaec6bb (the statistics core's parent), then today-only references
OPS = ("log_probs_and_entropy", "log_probs_and_entropy_inplace", "topk_ids", "topk_logprobs", "topk_kl",
       "lm_head_log_probs_and_entropy", "lm_head_topk_ids", "lm_head_topk_logprobs",
       # added after aaec6bb (a baseline without them shows "-"): the divergence family
       "topk_kl_jsd", "lm_head_divergence_jsd", "lm_head_divergence_forward_kl", "lm_head_divergence_mixed_kl")
REFERENCES = ("slime_logprobs", "logits_path")
DEFAULT_SHAPE = {"T": 1024, "V": 8192, "H": 256, "k": 8}
COLUMNS = ["op", "today_s", "baseline_s", "today_vs_baseline", "note"]
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ops_worker.py")


def package_root() -> str:
    """The folder holding today's ``megatron_rl_patches`` package."""
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def export_revision(rev: str, dest: str) -> str:
    """`rev`'s ``megatron_rl_patches`` exported into `dest` (from today's git checkout); ValueError
    naming the revision when git cannot."""
    root = package_root()
    archive = subprocess.run(["git", "-C", root, "archive", rev, "megatron_rl_patches"], capture_output=True)
    if archive.returncode != 0:
        why = archive.stderr.decode(errors="replace").strip().splitlines()
        raise ValueError(f"--baseline {rev}: git cannot export it from {root} ({why[-1] if why else 'no output'}); "
                         "pass a commit, tag or branch of this package's git checkout")
    subprocess.run(["tar", "-x", "-C", dest], input=archive.stdout, check=True)
    return dest


def time_op(src: str, op: str, shape: dict, repeats: int, timeout: float) -> float | None:
    """Seconds of one run of `op` (best of `repeats` in one fresh process) with `src`'s package;
    `shape` may add the inputs' ``dtype``, ``threads`` and ``cpu_time`` (one thread: its CPU time)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    case = json.dumps({"op": op, "repeats": repeats, **shape})
    try:
        done = subprocess.run([sys.executable, WORKER, case], env=env, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return None
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        print(f"bench ops: {op} failed in {src}: {done.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
        return None
    return float(json.loads(lines[-1])["time_s"])


def _median(values: list[float | None]) -> float | None:
    got = [v for v in values if v is not None]
    return statistics.median(got) if got else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def measure(baseline: str | None, shape: dict, runs: int, ops: tuple[str, ...] | None = None, repeats: int = 1,
            timeout: float = 900.0) -> list[dict]:
    """Interleaved medians over `runs` rounds: per op (default :data:`OPS`) today's and the
    baseline's seconds."""
    ops = OPS if ops is None else ops
    sides = {"today": package_root()}
    with tempfile.TemporaryDirectory(prefix="bench-ops-") as tmp:
        if baseline is not None:
            sides["baseline"] = export_revision(baseline, tmp)
        times: dict[tuple[str, str], list[float | None]] = {}
        for _ in range(runs):
            for op in (*ops, *REFERENCES):
                for side, src in sides.items():
                    if op in REFERENCES and side != "today":
                        continue
                    times.setdefault((op, side), []).append(time_op(src, op, shape, repeats, timeout))
    med = {key: _median(values) for key, values in times.items()}
    rows = []
    for op in (*ops, *REFERENCES):
        today, base = med.get((op, "today")), med.get((op, "baseline"))
        rows.append({"op": op, "today_s": today, "baseline_s": base, "today_vs_baseline": _ratio(today, base),
                     "note": ""})
    by_op = {row["op"]: row for row in rows}
    slime = by_op.get("slime_logprobs", {}).get("today_s")
    for op in ("log_probs_and_entropy", "log_probs_and_entropy_inplace"):
        if op in by_op and slime:
            by_op[op]["note"] = f"{_ratio(by_op[op]['today_s'], slime)}x slime's Function"
    logits_path = by_op.get("logits_path", {}).get("today_s")
    if "lm_head_log_probs_and_entropy" in by_op and logits_path:
        fused = by_op["lm_head_log_probs_and_entropy"]
        fused["note"] = f"{_ratio(fused['today_s'], logits_path)}x the logits path"
    return rows


def _described(rev: str) -> str:
    """`rev` with its commit's date and subject, so a plot's reader need not know the hash."""
    try:
        line = subprocess.run(["git", "log", "-1", "--format=%h %cs: %s", rev], capture_output=True, text=True,
                              timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        line = ""
    return textwrap.shorten(line, 60, placeholder="…") if line else rev


def write_outputs(rows: list[dict], out_dir: str, title: str, baseline: str | None = None) -> list[str]:
    """ops.md (the table) and, with matplotlib, ops.png (seconds per op, today and baseline)."""
    written = []
    path = os.path.join(out_dir, "ops.md")
    with open(path, "w") as fh:
        fh.write(f"{title}\n\n{markdown_table(COLUMNS, dict_cells(rows, COLUMNS))}\n")
    written.append(path)
    names = {"today": "this checkout", "baseline": f"baseline {_described(baseline)}" if baseline else "baseline"}
    bars = [{"op": r["op"], "side": names[side], "time_s": r[f"{side}_s"]} for r in rows
            for side in ("today", "baseline")]  # a side without a time shows "not measured"
    png = plot_grouped_bars(bars, os.path.join(out_dir, "ops.png"), group="op", series="side", values=["time_s"],
                            titles=[title], ylabel="seconds (median)")
    if png:
        written.append(png)
    return written


def run_ops(baseline: str | None, shape: dict, runs: int, out_dir: str | None, repeats: int = 1) -> list[dict]:
    """Measure, print the table, write it (and the plot) to `out_dir`."""
    title = (f"bench ops: T={shape['T']}, V={shape['V']}, H={shape['H']}, k={shape['k']}, CPU, 1 thread, fp32, "
             f"medians of {runs} interleaved runs; baseline {baseline or '(none)'}")
    rows = measure(baseline, shape, runs, repeats=repeats)
    print_table(rows, COLUMNS, title)
    if out_dir:
        for path in write_outputs(rows, out_dir, title, baseline):
            print(f"wrote {path}")
    return rows


# `bench ops --invariant`: log-prob + entropy in both modes, forward alone and with the backward;
# the baseline revision runs the invariant ones (its default path is today's)
INVARIANT_OPS = ("log_probs_and_entropy", "lm_head_log_probs_and_entropy")
INVARIANT_SHAPE = {"T": 1024, "V": 151936, "H": 256, "k": 8}
INVARIANT_COLUMNS = ["op", "dtype", "part", "default_s", "invariant_s", "baseline_invariant_s", "invariant_vs_default",
                     "baseline_vs_default"]


def measure_invariant(baseline: str | None, shape: dict, runs: int, dtypes: tuple[str, ...] = ("float32", "bfloat16"),
                      threads: int = 1, timeout: float = 900.0) -> list[dict]:
    """Interleaved medians over `runs` rounds of the default op, the invariant op and the baseline's
    invariant op (thread CPU time at one thread, wall time at more), per op, dtype and part."""
    sides = {"today": package_root()}
    times: dict[tuple[str, ...], list[float | None]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-ops-") as tmp:
        if baseline is not None:
            sides["baseline"] = export_revision(baseline, tmp)
        for _ in range(runs):
            for op in INVARIANT_OPS:
                for dtype in dtypes:
                    for part in ("forward", "forward_backward"):
                        case = dict(shape, dtype=dtype, threads=threads, cpu_time=threads == 1)
                        for side, mode in (("today", "default"), ("today", "invariant"), ("baseline", "invariant")):
                            if side in sides:
                                seconds = time_op(sides[side], f"{op}:{mode}:{part}", case, 1, timeout)
                                times.setdefault((op, dtype, part, side, mode), []).append(seconds)
    rows = []
    for op in INVARIANT_OPS:
        for dtype in dtypes:
            for part in ("forward", "forward_backward"):
                med = {(side, mode): _median(times.get((op, dtype, part, side, mode), []))
                       for side, mode in (("today", "default"), ("today", "invariant"), ("baseline", "invariant"))}
                default = med["today", "default"]
                rows.append({"op": op, "dtype": dtype, "part": part, "default_s": default,
                             "invariant_s": med["today", "invariant"],
                             "baseline_invariant_s": med["baseline", "invariant"],
                             "invariant_vs_default": _ratio(med["today", "invariant"], default),
                             "baseline_vs_default": _ratio(med["baseline", "invariant"], default)})
    return rows


def run_invariant(baseline: str | None, shape: dict, runs: int, out_dir: str | None, threads: int = 1) -> list[dict]:
    """:func:`measure_invariant`: print the table, write ops_invariant.md (and .png) to `out_dir`."""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    rows = measure_invariant(baseline, shape, runs, threads=threads)
    title = (f"bench ops --invariant: T={shape['T']}, V={shape['V']}, H={shape['H']} (fused head), CPU, "
             f"{threads} thread{'s' if threads > 1 else ''}, medians of {runs} interleaved runs "
             f"({'thread CPU' if threads == 1 else 'wall'} time); baseline {baseline or '(none)'}; "
             f"load average {load:.1f} at the end")
    print_table(rows, INVARIANT_COLUMNS, title)
    if out_dir:
        with open(os.path.join(out_dir, "ops_invariant.md"), "w") as fh:
            fh.write(f"{title}\n\n{markdown_table(INVARIANT_COLUMNS, dict_cells(rows, INVARIANT_COLUMNS))}\n")
        names = {"default_s": "default", "invariant_s": "invariant (this checkout)",
                 "baseline_invariant_s": f"invariant ({_described(baseline)})" if baseline else "invariant (baseline)"}
        bars = [{"case": f"{r['op'].replace('_log_probs_and_entropy', '')}\n{r['dtype']} {r['part']}",
                 "side": names[key], "time_s": r[key]} for r in rows for key in names]
        plot_grouped_bars(bars, os.path.join(out_dir, "ops_invariant.png"), group="case", series="side",
                          values=["time_s"], titles=[title], ylabel="seconds (median)")
    return rows
