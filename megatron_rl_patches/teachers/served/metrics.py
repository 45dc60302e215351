"""What a served teacher did since it was last asked (`Recorder`, read by `ServedTeacher.metrics()`):
samples and response rows answered, bytes received, each replica's requests (answered, failed) and
their latency p50 / p95, the client's retries, the samples failed over to another replica, the
hedged copies sent and won, and the replicas taken out. A dashboard reads it once a step: one call
a step is that step's figures. Every URL is shown redacted. Standard library only."""
from __future__ import annotations

import math
import threading
from collections import defaultdict
from typing import Any

from megatron_rl_patches.teachers.redaction import redacted

COUNTS = ("samples", "rows", "bytes", "retries", "failovers", "hedges_sent", "hedges_won")


class Recorder:
    """Counts added from any thread; `take()` returns them and starts again from zero."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        self.counts = dict.fromkeys(COUNTS, 0)
        self.latencies: dict[str, list[float]] = defaultdict(list)
        self.failures: dict[str, int] = defaultdict(int)
        self.taken_out: list[str] = []

    def add(self, name: str, value: int = 1) -> None:
        with self.lock:
            self.counts[name] += value

    def answered(self, url: str, seconds: float) -> None:
        with self.lock:
            self.latencies[redacted(url)].append(seconds)

    def failed(self, url: str) -> None:
        with self.lock:
            self.failures[redacted(url)] += 1

    def took_out(self, url: str) -> None:
        with self.lock:
            self.taken_out.append(redacted(url))

    def take(self) -> dict[str, Any]:
        """The figures since the last `take` (see the module's words), then zero."""
        with self.lock:
            counts, latencies, failures, taken_out = self.counts, self.latencies, self.failures, self.taken_out
            self.reset()
        replicas = {url: {"requests": len(latencies.get(url, [])) + failures.get(url, 0),
                          "failed": failures.get(url, 0),
                          "latency_p50_s": percentile(latencies.get(url, []), 0.50),
                          "latency_p95_s": percentile(latencies.get(url, []), 0.95)}
                    for url in sorted(set(latencies) | set(failures))}
        return {**counts, "replicas": replicas, "taken_out": taken_out}


def percentile(values: list[float], q: float) -> float | None:
    """The nearest-rank `q` quantile of `values` (None: no value)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]
