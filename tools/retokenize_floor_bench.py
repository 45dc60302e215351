"""`retokenize` against the floor any retokenizer pays (docs/benchmarks.md, "Cross-tokenizer
alignment"): the student's decode of each response plus the teacher's encode of its text (with
boundaries, of each segment apart), timed interleaved in one process, one core, CPU seconds;
100 responses of ~2,000 Qwen3 tokens (the test texts from shifted starts), plain and with a
boundary every 64 tokens. `--before DIR`: the same calls through another checkout's `retokenize`.

    PYTHONPATH=$PWD python tools/retokenize_floor_bench.py [--before DIR] [--rounds 5]"""
from __future__ import annotations

import argparse
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


def main() -> None:
    from tools.cross_tokenizer_bench import tokenizers_of
    from tools.cross_tokenizer_segments_bench import retokenize_of

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", help="a checkout whose retokenize to time beside this one")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
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


if __name__ == "__main__":
    main()
