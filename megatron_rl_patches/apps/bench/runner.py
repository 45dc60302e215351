"""Running benchmark cases, each in a fresh Python process (so one case's allocator state cannot
leak into the next). A case is a module-level function ``fn(probe: MemoryProbe, **kwargs) -> dict``
named ``"package.module:function"``; :func:`run_cases` returns the dicts the cases produced."""
from __future__ import annotations

import gc
import json
import os
import pkgutil
import subprocess
import sys
import threading
import traceback
from collections.abc import Sequence

from megatron_rl_patches.apps.bench.measure import MemoryProbe, reset_peak_rss
from megatron_rl_patches.apps.bench.progress import CaseLines

_RESULT = "@@bench-result@@ "


def run_case_here(target: str, kwargs: dict) -> dict:
    """Import ``module:function`` and call it with a fresh :class:`MemoryProbe`."""
    fn = pkgutil.resolve_name(target)
    return fn(MemoryProbe(kwargs.get("device", "cpu")), **kwargs)


def run_cases(cases: Sequence[dict], *, isolate: bool = True, threads: int = 1, timeout: float = 900.0) -> list[dict]:
    """Run ``{"target": "mod:fn", "kwargs": {...}}`` cases in fresh Python processes.

    `isolate=True`: one process per case. `isolate=False` (quick runs: one interpreter start
    instead of many) shares one process, which is only honoured where the peak-RSS mark can be
    reset between cases (Linux); elsewhere cases stay isolated. Returns one dict per case (its
    result, or ``{"error": ...}``). `threads` sets torch's intra-op threads in the worker. A line
    on stderr marks each case as it ends, so a long benchmark shows progress.
    """
    if not isolate and not reset_peak_rss():  # this OS cannot reset the peak-RSS mark between cases
        isolate = True
    batches = [[case] for case in cases] if isolate else [list(cases)]
    progress = _Progress(len(cases))
    results: list[dict] = []
    for batch in batches:
        results += _run_batch(batch, threads, timeout * len(batch), progress)
    return results


class _Progress:
    """`  case 3/12 done (4.1 s): fn T=1024 V=8192` on stderr as each case ends (progress.CaseLines)."""

    def __init__(self, total: int) -> None:
        self.lines = CaseLines(total)

    def case_ended(self, case: dict, result: dict) -> None:
        target = case["target"].rpartition(":")[2]
        shape = " ".join(f"{k}={v}" for k, v in case.get("kwargs", {}).items() if isinstance(v, (int, str)))
        self.lines.ended(f"{target} {shape}", failed=bool(result.get("error")))


def _run_batch(batch: list[dict], threads: int, timeout: float, progress: _Progress) -> list[dict]:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    payload = json.dumps({"cases": [{"target": c["target"], "kwargs": c.get("kwargs", {})} for c in batch],
                          "threads": threads})
    proc = subprocess.Popen([sys.executable, "-m", "megatron_rl_patches.apps.bench.runner"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    stderr: list[str] = []
    reader = threading.Thread(target=lambda: stderr.extend(proc.stderr or ()), daemon=True)
    reader.start()
    found: list[dict] = []
    try:
        assert proc.stdin is not None and proc.stdout is not None  # both are pipes
        proc.stdin.write(payload)
        proc.stdin.close()
        for line in proc.stdout:  # results stream in as the worker finishes each case
            if line.startswith(_RESULT):
                found.append(json.loads(line[len(_RESULT):]))
                progress.case_ended(batch[len(found) - 1], found[-1])
        proc.wait()
    finally:
        timed_out = not timer.is_alive() and proc.returncode is not None and proc.returncode < 0
        timer.cancel()
        reader.join(timeout=5)
    if len(found) < len(batch):
        why = (f"timed out after {timeout:.0f}s" if timed_out else
               f"worker exit {proc.returncode}: " + " | ".join("".join(stderr).strip().splitlines()[-5:]))
        for case in batch[len(found):]:
            found.append({"error": why})
            progress.case_ended(case, found[-1])
    return found


def _worker() -> int:
    request = json.loads(sys.stdin.read())
    import torch  # lazy: import cost: the driver imports this module; torch loads in the case worker only

    torch.set_num_threads(int(request.get("threads", 1)))
    for case in request["cases"]:
        try:
            result = run_case_here(case["target"], case["kwargs"])
        except Exception as exc:  # the parent reports it in the table
            traceback.print_exc()
            result = {"error": f"{type(exc).__name__}: {exc}"}
        sys.stdout.write(_RESULT + json.dumps(result) + "\n")
        sys.stdout.flush()
        gc.collect()
    return 0


if __name__ == "__main__":
    raise SystemExit(_worker())
