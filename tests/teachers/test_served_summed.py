"""Several served teachers' `metrics()` as one (`step_metrics.served_summed`, what verl's route
sums over a worker's teachers and then over the workers, issue 88 item 4): counts summed, replicas
taken out joined, per replica its counts summed and the larger of the parts' percentiles; the
parts untouched. Pure logic: verl's real agent loop in
tests/integrations/verl/lane/test_verl_teacher_metrics.py."""
from __future__ import annotations

import copy

from megatron_rl_patches.teachers.step.metrics import flat, served_summed


def figures(samples: int, url: str, p50: float | None, p95: float | None, failed: int = 0,
            taken_out: tuple[str, ...] = ()) -> dict:
    return {"samples": samples, "rows": 10 * samples, "bytes": 100 * samples, "retries": failed, "failovers": failed,
            "hedges_sent": 1, "hedges_won": 0, "taken_out": list(taken_out),
            "replicas": {url: {"requests": samples + failed, "failed": failed, "latency_p50_s": p50,
                               "latency_p95_s": p95}}}


def test_counts_are_summed_and_each_replica_keeps_the_slowest_parts_percentile():
    a = figures(2, "http://a:8000", 0.1, 0.3)
    b = figures(3, "http://a:8000", 0.2, 0.25, failed=1, taken_out=("http://b:8000",))
    c = figures(1, "http://b:8000", None, None)
    parts = [a, b, c]
    before = copy.deepcopy(parts)
    got = served_summed(parts)
    assert parts == before  # the parts as they were
    assert (got["samples"], got["rows"], got["bytes"]) == (6, 60, 600)
    assert (got["retries"], got["failovers"], got["hedges_sent"], got["hedges_won"]) == (1, 1, 3, 0)
    assert got["taken_out"] == ["http://b:8000"]
    assert got["replicas"] == {
        "http://a:8000": {"requests": 6, "failed": 1, "latency_p50_s": 0.2, "latency_p95_s": 0.3},
        "http://b:8000": {"requests": 1, "failed": 0, "latency_p50_s": None, "latency_p95_s": None}}
    keys = flat(got)
    assert keys["teacher/samples"] == 6 and keys["teacher/taken_out"] == 1
    assert keys["teacher/replica/a:8000/latency_p95_s"] == 0.3 and "teacher/replica/b:8000/latency_p50_s" not in keys


def test_a_sum_of_sums_is_the_sum_of_all():
    parts = [figures(i + 1, f"http://r{i % 2}:8000", 0.1 * i, 0.2 * i) for i in range(4)]
    assert served_summed([served_summed(parts[:2]), served_summed(parts[2:])]) == served_summed(parts)


def test_no_part_is_zeros():
    assert served_summed([]) == {"samples": 0, "rows": 0, "bytes": 0, "retries": 0, "failovers": 0,
                                 "hedges_sent": 0, "hedges_won": 0, "taken_out": [], "replicas": {}}
