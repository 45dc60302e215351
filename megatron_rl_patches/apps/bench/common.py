"""Shared benchmark plumbing: per-case memory in a fresh process, saved-for-backward bytes, timing,
and the table / CSV / PNG outputs.

A case is a module-level function ``fn(probe: MemoryProbe, **kwargs) -> dict`` named
``"package.module:function"``. :func:`run_cases` runs each case in a fresh Python process (so
one case's allocator state cannot leak into the next) and returns the dicts it produced.
"""
from __future__ import annotations

import csv
import json
import math
import os
import pkgutil
import re
import subprocess
import sys
import textwrap
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from megatron_rl_patches.apps.presentation import dict_cells, markdown_table, text_table

MIB = 1 << 20
_RESULT = "@@bench-result@@ "
# On CPU memory is the resident set's high-water mark, which moves in allocator-sized steps:
# below this many bytes per U its figures are noise and are left out (quick runs). The CUDA
# allocator's peak is exact.
RSS_RESOLUTION = 64 << 20
BELOW_RESOLUTION = "memory below measurement resolution (U < 64 MiB)"


def memory_resolved(unit_bytes: int, device: str) -> bool:
    """Whether peak figures in units of `unit_bytes` mean anything on `device`."""
    return device.startswith("cuda") or unit_bytes >= RSS_RESOLUTION


# ------------------------------------------------------------------------------- memory


def _proc_status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as fh:
            match = re.search(rf"^{field}:\s+(\d+) kB", fh.read(), re.MULTILINE)
    except OSError:
        return None
    return int(match.group(1)) if match else None


def _rss_bytes() -> int:
    kib = _proc_status_kib("VmRSS")
    if kib is not None:
        return kib * 1024
    import psutil  # non-Linux fallback

    return psutil.Process().memory_info().rss


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (Linux >= 4.0: write 5 to /proc/self/clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        return False
    return _proc_status_kib("VmHWM") is not None


def _peak_rss_bytes() -> int:
    kib = _proc_status_kib("VmHWM")
    if kib is not None:
        return kib * 1024
    import resource

    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


class MemoryProbe:
    """Memory above a baseline taken by :meth:`start`: the CUDA caching allocator's counters on
    GPU, the process's resident set on CPU (peak via the kernel's high-water mark, reset at
    start where Linux allows; otherwise the lifetime peak, meaningful in a fresh process)."""

    def __init__(self, device: str = "cpu") -> None:
        import torch

        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.peak_reset = False
        self._base = 0

    def start(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
            self.peak_reset = True
        else:
            self.peak_reset = _reset_peak_rss()
            self._base = _rss_bytes()

    def current(self) -> int:
        if self.cuda:
            import torch

            torch.cuda.synchronize(self.device)
            return torch.cuda.memory_allocated(self.device) - self._base
        return _rss_bytes() - self._base

    def peak(self) -> int:
        if self.cuda:
            import torch

            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device) - self._base
        return _peak_rss_bytes() - self._base


class SavedBytes:
    """Bytes autograd saves for backward inside the block, each storage counted once.

    Storages of `ignore` (e.g. weights that exist anyway) are not counted.
    """

    def __init__(self, ignore: Iterable[Any] = ()) -> None:
        self._ignore = {t.untyped_storage().data_ptr() for t in ignore}
        self.storages: dict[int, int] = {}
        self._hooks: Any = None

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())

    def _pack(self, tensor: Any) -> Any:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self._ignore:
            self.storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    def __enter__(self) -> SavedBytes:
        import torch

        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)


def best_time(fn: Callable[[], Any], *, repeat: int = 3, warmup: int = 1, sync: Callable[[], Any] | None = None,
              setup: Callable[[], Any] | None = None) -> float:
    """Shortest wall time of ``fn(setup())`` (or ``fn()``) over `repeat` runs, after `warmup` runs."""
    times = []
    for i in range(warmup + repeat):
        arg = setup() if setup is not None else None
        if sync:
            sync()
        start = time.perf_counter()
        fn(arg) if setup is not None else fn()
        if sync:
            sync()
        if i >= warmup:
            times.append(time.perf_counter() - start)
        del arg
    return min(times)


# ------------------------------------------------------------------------------- processes


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
    if not isolate and not _reset_peak_rss():  # this OS cannot reset the peak-RSS mark between cases
        isolate = True
    batches = [[case] for case in cases] if isolate else [list(cases)]
    progress = _Progress(len(cases))
    results: list[dict] = []
    for batch in batches:
        results += _run_batch(batch, threads, timeout * len(batch), progress)
    return results


class _Progress:
    """`  case 3/12 done (4.1 s): fn T=1024 V=8192` on stderr as each case ends."""

    def __init__(self, total: int) -> None:
        self.total, self.done, self.since = total, 0, time.perf_counter()

    def case_ended(self, case: dict, result: dict) -> None:
        self.done += 1
        now = time.perf_counter()
        target = case["target"].rpartition(":")[2]
        shape = " ".join(f"{k}={v}" for k, v in case.get("kwargs", {}).items() if isinstance(v, (int, str)))
        state = "failed" if result.get("error") else "done"
        print(f"  case {self.done}/{self.total} {state} ({now - self.since:.1f} s): {target} {shape}".rstrip(),
              file=sys.stderr, flush=True)
        self.since = now


def _run_batch(batch: list[dict], threads: int, timeout: float, progress: _Progress) -> list[dict]:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    payload = json.dumps({"cases": [{"target": c["target"], "kwargs": c.get("kwargs", {})} for c in batch],
                          "threads": threads})
    proc = subprocess.Popen([sys.executable, "-m", "megatron_rl_patches.apps.bench.common"], stdin=subprocess.PIPE,
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
    import gc

    import torch

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


# ------------------------------------------------------------------------------- outputs


def format_table(rows: Sequence[dict], columns: Sequence[str], title: str | None = None) -> str:
    """A fixed-width text table of `columns` (missing values shown as '-')."""
    return text_table(columns, dict_cells(rows, columns), title=title)


def print_table(rows: Sequence[dict], columns: Sequence[str], title: str | None = None) -> None:
    """Print :func:`format_table` (benchmarks are CLI output)."""
    print(format_table(rows, columns, title), flush=True)


def write_csv(rows: Sequence[dict], path: str, columns: Sequence[str] | None = None) -> str:
    """Write rows to `path` (columns: the given ones, else every key in first-seen order)."""
    if columns is None:
        columns = list(dict.fromkeys(key for row in rows for key in row))
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(columns), extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({col: row.get(col, "") for col in columns})
    return path


def write_tables(rows: Sequence[dict], columns: Sequence[str], out_dir: str, name: str,
                 title: str | None = None) -> None:
    """`name`.csv (every field) and `name`.md (`columns`, under `title` when given) into `out_dir`."""
    os.makedirs(out_dir, exist_ok=True)
    write_csv(rows, os.path.join(out_dir, f"{name}.csv"))
    table = markdown_table(columns, dict_cells(rows, columns))
    with open(os.path.join(out_dir, f"{name}.md"), "w") as fh:
        fh.write((f"{title}\n\n{table}" if title else table) + "\n")


# Every plot whose panels are in U says what U is (issue 29: the unit was only in the tables).
U_NOTE = "U = T·V·4 bytes (one fp32 copy of the [T, V] logits)"
_LABEL_WIDTH = 16  # characters per line of an x label: wrapped, so neighbours do not overlap


NO_FIGURES = "no figures in this run: see the table's notes (--quick shapes are below memory resolution on CPU)"
_NOTE_WIDTH = 34  # characters per line of a panel's note: it stays inside the panel
QUICK_NOTE = "[--quick: tiny shapes, fixed costs dominate; not representative]"


def titled(title: str, quick: bool) -> str:
    """A table's or plot's title, saying --quick where it was (its figures mean little)."""
    return f"{title}\n{QUICK_NOTE}" if quick else title


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def _wrapped(label: str) -> str:
    """`label` on lines of about _LABEL_WIDTH characters, broken between words only (a name such
    as disable_forward_pre_hook stays whole)."""
    return "\n".join(line for part in label.split("\n")
                     for line in textwrap.wrap(part, _LABEL_WIDTH, break_long_words=False, break_on_hyphens=False)
                     or [part])


def _uses_u(texts: Sequence[str]) -> bool:
    return any(re.search(r"(^|[\s(/])U(\b|$)", text) for text in texts)


def grouped_bars_figure(
    rows: Sequence[dict], *, group: str, series: str, values: Sequence[str], titles: Sequence[str],
    suptitle: str = "", ylabel: str = "", missing_label: str = "not measured", empty_note: str = NO_FIGURES,
) -> Any:
    """The figure of :func:`plot_grouped_bars` (matplotlib imported by the caller). A series with
    no number for a group gets `missing_label` written where its bar would be (e.g. "crashes"); a
    panel with no number at all says `empty_note` instead of showing an empty axis."""
    import matplotlib.pyplot as plt

    groups = list(dict.fromkeys(str(row[group]) for row in rows))
    names = list(dict.fromkeys(str(row[series]) for row in rows))
    labels = [_wrapped(g) for g in groups]
    longest = max((len(line) for label in labels for line in label.splitlines()), default=1)
    panel = max(5.5, len(groups) * max(0.6, 0.08 * longest) + 1.5)  # inches: room for every label
    fig, axes = plt.subplots(1, len(values), figsize=(panel * len(values), 4.2), squeeze=False)
    width = 0.8 / max(1, len(names))
    for ax, value, title in zip(axes[0], values, titles):
        empty = not any(_finite(r.get(value)) for r in rows)  # e.g. memory below resolution in --quick
        if empty:  # the note alone, wrapped to the panel: no per-bar labels under it
            ax.text(0.5, 0.6, textwrap.fill(empty_note, _NOTE_WIDTH), transform=ax.transAxes, ha="center",
                    va="center", fontsize=8)
            ax.set_yticks([])
        for i, name in enumerate(names):
            heights, missing = [], []
            for j, g in enumerate(groups):
                match = [r for r in rows if str(r[group]) == g and str(r[series]) == name]
                v = match[0].get(value) if match else None
                number = _finite(v)
                heights.append(float(v) if number else 0.0)
                if match and not number:
                    missing.append(j + i * width)
            ax.bar([j + i * width for j in range(len(groups))], heights, width, label=name)
            for x in missing if missing_label and not empty else ():
                ax.text(x, 0, f" {missing_label}", rotation=90, ha="center", va="bottom", fontsize=8)
        ax.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(groups))])
        ax.set_xticklabels(labels, fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.set_ylabel(ylabel)
        ax.grid(axis="y", alpha=0.3)
    if len(names) > 1:  # one series needs no legend (an empty-looking box otherwise)
        axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    if _uses_u([*titles, ylabel]) and U_NOTE not in suptitle:
        suptitle = f"{suptitle}\n{U_NOTE}" if suptitle else U_NOTE
    if suptitle:
        fig.suptitle(suptitle, fontsize=11)
    fig.tight_layout()
    return fig


def plot_grouped_bars(
    rows: Sequence[dict], path: str, *, group: str, series: str, values: Sequence[str], titles: Sequence[str],
    suptitle: str = "", ylabel: str = "", missing_label: str = "not measured", empty_note: str = NO_FIGURES,
) -> str | None:
    """One panel per entry of `values`: bars of each `series` within each `group`, written to
    `path`. Needs matplotlib (imported here only); returns the path, or None when it is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig = grouped_bars_figure(rows, group=group, series=series, values=values, titles=titles, suptitle=suptitle,
                              ylabel=ylabel, missing_label=missing_label, empty_note=empty_note)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


if __name__ == "__main__":
    raise SystemExit(_worker())
