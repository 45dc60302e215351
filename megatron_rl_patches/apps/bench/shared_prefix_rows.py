"""One row of `bench shared-prefix`'s tables from a route's timed rounds: the medians of its wall and
CPU times, its CPU time's ratio per round to the unshared route's (the same round: both saw the same
load), and its activations kept against the unshared route's."""
from __future__ import annotations

import statistics
from typing import Any

from megatron_rl_patches.apps.bench.measure import MIB


def timed_row(case: str, packing: str, tokens: int, own: dict[str, list], plain: dict[str, list], saved: int,
              saved_plain: int, diff: float, note: str | None = None) -> dict[str, Any]:
    """The row of route `packing` in `case`: `own` / `plain` map "forward" and "train" to the rounds'
    (wall, CPU) seconds of this route and of the unshared one, `saved` / `saved_plain` their
    activations kept (bytes), `diff` the largest log-prob difference to the unshared route."""
    def median(kind: str, which: int) -> float:
        return statistics.median(t[which] for t in own[kind]) * 1e3

    ratio = {kind: statistics.median(a[1] / b[1] for a, b in zip(own[kind], plain[kind]))
             for kind in ("forward", "train")}
    row = {"case": case, "packing": packing, "tokens": tokens,
           "forward_ms": median("forward", 0), "forward_cpu_ms": median("forward", 1),
           "forward_vs_unshared": ratio["forward"],
           "train_ms": median("train", 0), "train_cpu_ms": median("train", 1), "train_vs_unshared": ratio["train"],
           "activations_MiB": saved / MIB, "activations_vs_unshared": saved / saved_plain, "max_abs_diff": diff}
    if note is not None:
        row["note"] = note
    return row
