"""`bench grouping`: what finding a micro-batch's groups by value costs as the samples grow.

`find_groups` and `shared_prefix_micro_batches` (budget: 8 samples' tokens) over n samples of a
P-token prompt and an R-token response each (P = 1,024, R = 128), at n = 1,024, 4,096 and 16,384:
every sample sharing one prompt (one group of n: what grew as n^2 before issue 110), and no two
sharing one. Each row: the least CPU time of `runs` (one core, `time.process_time`) and its ratio
to the row of a quarter of the samples (4x the samples: at most 5x the time where the cost grows as
n log n; 16x where it grows as n^2)."""
# lazy imports: import cost: torch loads when the benchmark runs
from __future__ import annotations

import random
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from megatron_rl_patches.apps.bench import outputs

FULL: dict[str, Any] = {"prompt": 1024, "response": 128, "sizes": (1024, 4096, 16384), "runs": 3}
QUICK: dict[str, Any] = {"prompt": 64, "response": 16, "sizes": (64, 256, 1024), "runs": 1}
COLUMNS = ("call", "samples_share", "n", "cpu_s", "vs_quarter", "groups", "micro_batches")
SHAPES = ("one prompt", "nothing")


def samples_of(n: int, prompt: int, response: int, shape: str, seed: int = 0) -> list[list[int]]:
    """n samples of `prompt` + `response` ids: all with one prompt, or each with its own."""
    rng = random.Random(seed)
    shared = [rng.randrange(1000, 150_000) for _ in range(prompt)]
    return [(shared if shape == "one prompt" else [rng.randrange(1000, 150_000) for _ in range(prompt)])
            + [rng.randrange(1000, 150_000) for _ in range(response)] for _ in range(n)]


def least_cpu(fn: Callable[[], Any], runs: int) -> tuple[float, Any]:
    """The least CPU seconds of `runs` calls of `fn`, and its result."""
    best, result = float("inf"), None
    for _ in range(runs):
        started = time.process_time()
        result = fn()
        best = min(best, time.process_time() - started)
    return best, result


def measure(plan: dict) -> list[dict]:
    from megatron_rl_patches.shared_prefix import shared_prefix_micro_batches
    from megatron_rl_patches.shared_prefix.grouping import find_groups

    budget = 8 * (plan["prompt"] + plan["response"])
    rows = []
    for shape in SHAPES:
        for call in ("find_groups", "shared_prefix_micro_batches"):
            previous = None
            for n in plan["sizes"]:
                samples = samples_of(n, plan["prompt"], plan["response"], shape)
                if call == "find_groups":
                    seconds, groups = least_cpu(partial(find_groups, samples), plan["runs"])
                    row = {"groups": sum(1 for g in groups if g.shared)}
                else:
                    seconds, batches = least_cpu(partial(shared_prefix_micro_batches, samples, budget), plan["runs"])
                    row = {"micro_batches": len(batches)}
                rows.append({"call": call, "samples_share": shape, "n": n, "cpu_s": seconds,
                             "vs_quarter": seconds / previous if previous else None, **row})
                print(f"  {call}, {shape}, n={n}: {seconds:.3f} s", flush=True)
                previous = seconds
    return rows


def run(quick: bool = False, out_dir: str | None = None) -> list[dict]:
    """Print the table; write grouping.csv / .md into `out_dir` when given."""
    plan = QUICK if quick else FULL
    title = outputs.titled(
        f"grouping by value: n samples of P={plan['prompt']} + R={plan['response']} tokens, CPU seconds on one "
        f"core (least of {plan['runs']}), vs_quarter: against n / 4 (n log n: <= 5x; n^2: 16x)", quick)
    return outputs.reported(outputs.measured(lambda: measure(plan), "call"), COLUMNS, title, out_dir, "grouping")
