"""A teacher step's figures for a dashboard (`TeacherStep.metrics()`), framework-free:

- the step's own: `samples` and `rows` (response rows) collected, `adds` (parts handed over),
  `collects`, `scored_before` (samples added with their served scores, `add(scored=...)`: asked
  during the rollout, not by the step), `collect_s` (seconds inside `collect()`) and
  `collect_wait_s` (of those, the seconds the asking rank waited for the asynchronous teachers'
  answers: what a served teacher still adds to the step after the student's forward; the other
  ranks of its sharing group wait for it in the share, and count 0 here);
- its served teachers' (each one's `metrics()`, `served.metrics.Recorder`), summed: `bytes`,
  `retries`, `failovers`, `hedges_sent`, `hedges_won`, `taken_out` (redacted URLs), `replicas`
  (per redacted URL: requests, failed, latency p50 / p95; a URL serving two of the step's teachers:
  counts summed, the larger of the two percentiles); each teacher's own under `teachers` (by index).

The served figures are the asking rank's (the others ask nothing: zeros there). `flat(metrics)`
gives the `teacher/...` keys a framework's metrics dict takes (numbers only)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

SUMMED = ("bytes", "retries", "failovers", "hedges_sent", "hedges_won")
# a served teacher's counts (`served.metrics.Recorder`): its samples and rows besides the summed ones
SERVED_COUNTS = ("samples", "rows", *SUMMED)
PERCENTILES = ("latency_p50_s", "latency_p95_s")


class StepFigures:
    """The step's own counts since the last `take()`."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.samples = self.rows = self.adds = self.collects = self.scored_before = 0
        self.collect_s = self.collect_wait_s = 0.0

    def take(self) -> dict[str, Any]:
        out = {"samples": self.samples, "rows": self.rows, "adds": self.adds, "collects": self.collects,
               "scored_before": self.scored_before, "collect_s": self.collect_s,
               "collect_wait_s": self.collect_wait_s}
        self.reset()
        return out


def merged_replicas(each: Sequence[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per replica URL its figures over the teachers (counts summed, the larger percentile)."""
    out: dict[str, dict[str, Any]] = {}
    for replicas in each:
        for url, figures in replicas.items():
            if url not in out:
                out[url] = dict(figures)
                continue
            mine = out[url]
            mine["requests"] += figures["requests"]
            mine["failed"] += figures["failed"]
            for name in PERCENTILES:
                known = [v for v in (mine[name], figures[name]) if v is not None]
                mine[name] = max(known) if known else None
    return out


def step_metrics(own: dict[str, Any], served: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """The step's dict: its own figures, the served teachers' summed, each teacher's by index."""
    out = dict(own)
    for name in SUMMED:
        out[name] = sum(int(one.get(name, 0)) for one in served.values())
    out["taken_out"] = [url for one in served.values() for url in one.get("taken_out", [])]
    out["replicas"] = merged_replicas([one.get("replicas", {}) for one in served.values()])
    out["teachers"] = dict(served)
    return out


def served_summed(each: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Several served teachers' `metrics()` (or sums of them) as one: the counts summed, `taken_out`
    joined, `replicas` merged (counts summed, per replica the larger percentile of the parts: an
    upper bound of the whole's, not its percentile)."""
    out: dict[str, Any] = {name: sum(int(one.get(name, 0)) for one in each) for name in SERVED_COUNTS}
    out["taken_out"] = [url for one in each for url in one.get("taken_out", [])]
    out["replicas"] = merged_replicas([one.get("replicas", {}) for one in each])
    return out


def flat(metrics: dict[str, Any], prefix: str = "teacher/") -> dict[str, float]:
    """`metrics` (a `TeacherStep.metrics()` dict) as flat number-valued keys: `teacher/samples`,
    `teacher/collect_wait_s`, `teacher/taken_out` (a count), `teacher/replica/HOST:PORT/latency_p95_s`
    (a percentile without an answer left out)."""
    out: dict[str, float] = {}
    for name, value in metrics.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        out[prefix + name] = value
    out[prefix + "taken_out"] = len(metrics.get("taken_out", []))
    for url, figures in metrics.get("replicas", {}).items():
        where = url.split("://", 1)[-1].rstrip("/")
        for name, value in figures.items():
            if value is not None:
                out[f"{prefix}replica/{where}/{name}"] = value
    return out


# `fixed_figures`' keys besides `taken_out` and the percentiles: the same on every rank
FIXED_COUNTS = ("samples", "rows", "scored_before", "collect_s", "collect_wait_s", *SUMMED)


def fixed_figures(each: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Several `TeacherStep.metrics()` dicts as one of fixed keys, every value a float (a framework
    that averages a dict over its ranks needs every rank's to have the same keys): the counts
    summed, `taken_out` a count, the slowest replica's `latency_p50_s` / `latency_p95_s` (0 without
    an answer)."""
    out = {name: float(sum(one.get(name, 0) for one in each)) for name in FIXED_COUNTS}
    out["taken_out"] = float(sum(len(one.get("taken_out", [])) for one in each))
    for name in PERCENTILES:
        known = [figures[name] for one in each for figures in one.get("replicas", {}).values()
                 if figures.get(name) is not None]
        out[name] = float(max(known)) if known else 0.0
    return out
