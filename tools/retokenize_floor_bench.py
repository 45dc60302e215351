"""`retokenize` against the floor any retokenizer pays (docs/benchmarks.md, "Cross-tokenizer
alignment"): the student's decode of each response plus the teacher's encode of its text (with
boundaries, of each segment apart), timed interleaved in one process, one core, CPU seconds;
100 responses of ~2,000 Qwen3 tokens (the test texts from shifted starts), plain and with a
boundary every 64 tokens. `--before DIR`: the same calls through another checkout's `retokenize`
(its whole package, imported apart); `--out DIR`: the rows as retokenize_floor.csv and their
ratios as retokenize_floor.png, the load average stated.

    PYTHONPATH=$PWD python tools/retokenize_floor_bench.py [--before DIR] [--rounds 5] [--out DIR]"""
from __future__ import annotations

import argparse
import csv
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

os.environ.setdefault("RAYON_NUM_THREADS", "1")  # the tokenizers library's thread pool: one core
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from megatron_rl_patches import cross_tokenizer as ct  # noqa: E402

torch.set_num_threads(1)
EVERY = 64


def responses(tokenizer, count: int = 100, length: int = 2000) -> list[list[int]]:
    from tests.cross_tokenizer.conftest import TEXTS

    base = [i for text in TEXTS.values() for i in tokenizer.encode(text, add_special_tokens=False).ids]
    long = base * (length // len(base) + 2)
    return [long[k * 37 % len(base):][:length] for k in range(count)]


def cpu_seconds(work: Callable[[], object]) -> float:
    start = time.process_time()
    work()
    return time.process_time() - start


def floor(samples: list[list[int]], s_tok, t_tok, every: int) -> None:
    """The student's decode and the teacher's encode of every response (of each segment apart)."""
    for ids in samples:
        step = every or len(ids)
        for lo in range(0, len(ids), step):
            t_tok.encode(s_tok.decode(ids[lo:lo + step], skip_special_tokens=False), add_special_tokens=False)


def retokenize_all(function, samples: list[list[int]], s_tok, t_tok, every: int) -> None:
    for ids in samples:
        function(ids, s_tok, t_tok, boundaries=range(0, len(ids), every) if every else ())


def retokenize_of(tree: str):
    """The `retokenize` of the checkout at `tree` with all its own modules (alignment, arguments,
    spelling, ...): imported with `tree` first on the path, then this package's modules put back."""
    import importlib
    import sys

    ours = {name: module for name, module in sys.modules.items() if name.split(".")[0] == "megatron_rl_patches"}
    for name in ours:
        del sys.modules[name]
    sys.path.insert(0, str(Path(tree).resolve()))
    try:
        return importlib.import_module("megatron_rl_patches.cross_tokenizer.retokenizing").retokenize
    finally:
        sys.path.pop(0)
        for name in [name for name in sys.modules if name.split(".")[0] == "megatron_rl_patches"]:
            del sys.modules[name]
        sys.modules.update(ours)


def main() -> None:
    from tools.cross_tokenizer_bench import tokenizers_of

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", help="a checkout whose retokenize to time beside this one")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", help="a folder for retokenize_floor.csv and retokenize_floor.png")
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        toks = tokenizers_of(Path(tmp))
    before = retokenize_of(args.before) if args.before else None
    print(f"{'student -> teacher':<20} {'boundaries':>10} {'floor (s)':>9} {'ours (s)':>8} {'floor/ours':>10}"
          + (f" {'before (s)':>10} {'floor/before':>12}" if before else ""))
    for student, teacher in [("qwen3", "deepseek"), ("qwen3", "qwen3.5")]:
        s_tok, t_tok = toks[student], toks[teacher]
        samples = responses(s_tok)
        for every in (0, EVERY):
            kinds = {"floor": partial(floor, samples, s_tok, t_tok, every),
                     "ours": partial(retokenize_all, ct.retokenize, samples, s_tok, t_tok, every)}
            if before is not None:
                kinds["before"] = partial(retokenize_all, before, samples, s_tok, t_tok, every)
            for work in kinds.values():
                work()  # tables, encoders and caches built
            times: dict[str, list[float]] = {name: [] for name in kinds}
            for _ in range(args.rounds):
                for name, work in kinds.items():
                    times[name].append(cpu_seconds(work))
            best = {name: min(values) for name, values in times.items()}
            median = {name: statistics.median(values) for name, values in times.items()}
            row = (f"{student + ' -> ' + teacher:<20} {every or '-':>10} {best['floor']:>9.3f} {best['ours']:>8.3f} "
                   f"{median['floor'] / median['ours']:>10.2f}")
            if before is not None:
                row += f" {best['before']:>10.3f} {median['floor'] / median['before']:>12.2f}"
            print(row, flush=True)
            rows.append({"pair": f"{student} -> {teacher}", "every": every,
                         **{f"{name}_s": round(best[name], 4) for name in kinds},
                         **{f"floor/{name}": round(median["floor"] / median[name], 3)
                            for name in kinds if name != "floor"}})
    load = f"load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after (2 cores)"
    print(load)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "retokenize_floor.csv", "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
        plot(rows, load, out / "retokenize_floor.png")


def plot(rows: list[dict], load: str, path: Path) -> None:
    """Grouped bars: floor / retokenize per pair and boundary spacing, now and before, the target line."""
    import matplotlib  # lazy: optional dependency matplotlib (the extra `bench`)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: optional dependency matplotlib (the extra `bench`)

    figure, axis = plt.subplots(figsize=(6.5, 3.8))
    labels = [f"{row['pair']}\n{'every ' + str(row['every']) if row['every'] else 'plain'}" for row in rows]
    series = [name for name in ("floor/before", "floor/ours") if name in rows[0]]
    width = 0.8 / len(series)
    for k, name in enumerate(series):
        values = [row[name] for row in rows]
        bars = axis.bar([i + (k - (len(series) - 1) / 2) * width for i in range(len(rows))], values, width,
                        label="now" if name == "floor/ours" else "before")
        axis.bar_label(bars, fmt="%.2f", fontsize=7)
    axis.axhline(0.85, color="grey", linestyle="--", label="target 0.85")
    axis.set_xticks(range(len(rows)), labels, fontsize=7)
    axis.set_ylabel("floor / retokenize (CPU s)")
    axis.set_title(f"retokenize vs decode+encode floor, 100 x 2k Qwen3 tokens\n{load}", fontsize=9)
    axis.legend(fontsize=7, loc="lower right")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
