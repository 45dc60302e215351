"""`teachers.step.metrics` in memory, every dict compared whole: the step's own counts taken and
reset, replicas merged across teachers (counts summed, the larger percentile, a missing one left
None), the step's dict (the served teachers' counts summed, `taken_out` joined, each teacher under
its index), several served teachers summed with keys missing, `flat`'s number-valued
`teacher/...` keys (no bools, strings or lists; the scheme and a trailing '/' cut from a replica's
URL; a percentile without an answer left out; another prefix), and `fixed_figures`' fixed keys of
floats (the slowest replica's percentiles, 0 without an answer)."""
from __future__ import annotations

from megatron_rl_patches.teachers.step.metrics import (
    FIXED_COUNTS,
    StepFigures,
    fixed_figures,
    flat,
    merged_replicas,
    served_summed,
    step_metrics,
)

A, B = "http://a:8000", "https://b:9000/"


def replica(requests: int, failed: int, p50: float | None, p95: float | None) -> dict:
    return {"requests": requests, "failed": failed, "latency_p50_s": p50, "latency_p95_s": p95}


def served(bytes_: int, taken_out: list[str], replicas: dict, **more: int) -> dict:
    return {"samples": 2, "rows": 6, "bytes": bytes_, "retries": 1, "failovers": 0, "hedges_sent": 2,
            "hedges_won": 1, "taken_out": taken_out, "replicas": replicas, **more}


def test_the_steps_own_counts_are_taken_and_reset():
    figures = StepFigures()
    figures.samples, figures.rows, figures.adds, figures.collects, figures.scored_before = 3, 9, 2, 1, 1
    figures.collect_s, figures.collect_wait_s = 0.5, 0.25
    assert figures.take() == {"samples": 3, "rows": 9, "adds": 2, "collects": 1, "scored_before": 1,
                              "collect_s": 0.5, "collect_wait_s": 0.25}
    assert figures.take() == {"samples": 0, "rows": 0, "adds": 0, "collects": 0, "scored_before": 0,
                              "collect_s": 0.0, "collect_wait_s": 0.0}


def test_replicas_merge_counts_summed_and_the_larger_percentile():
    first = {A: replica(3, 1, 0.1, None), B: replica(1, 0, None, None)}
    second = {A: replica(2, 2, 0.3, 0.4)}
    merged = merged_replicas([first, second])
    assert merged == {A: replica(5, 3, 0.3, 0.4), B: replica(1, 0, None, None)}
    assert first[A] == replica(3, 1, 0.1, None)  # the parts are not changed
    assert merged_replicas([{A: replica(1, 0, None, None)}, {A: replica(1, 0, None, None)}]) == \
        {A: replica(2, 0, None, None)}


def test_the_steps_dict_sums_its_served_teachers_and_keeps_each():
    one = served(10, [A], {A: replica(3, 1, 0.1, 0.2)})
    two = served(5, [], {A: replica(1, 0, 0.3, 0.1)})
    got = step_metrics({"samples": 4, "collect_s": 1.5}, {0: one, 1: two})
    assert got == {"samples": 4, "collect_s": 1.5, "bytes": 15, "retries": 2, "failovers": 0, "hedges_sent": 4,
                   "hedges_won": 2, "taken_out": [A], "replicas": {A: replica(4, 1, 0.3, 0.2)},
                   "teachers": {0: one, 1: two}}
    assert step_metrics({}, {0: {}}) == {"bytes": 0, "retries": 0, "failovers": 0, "hedges_sent": 0, "hedges_won": 0,
                                         "taken_out": [], "replicas": {}, "teachers": {0: {}}}  # its keys missing
    assert step_metrics({"samples": 0}, {}) == {"samples": 0, "bytes": 0, "retries": 0, "failovers": 0,
                                                "hedges_sent": 0, "hedges_won": 0, "taken_out": [], "replicas": {},
                                                "teachers": {}}


def test_served_teachers_summed_with_missing_keys():
    got = served_summed([served(10, [A], {A: replica(3, 1, 0.1, 0.2)}), {"bytes": 4, "taken_out": [B]}])
    assert got == {"samples": 2, "rows": 6, "bytes": 14, "retries": 1, "failovers": 0, "hedges_sent": 2,
                   "hedges_won": 1, "taken_out": [A, B], "replicas": {A: replica(3, 1, 0.1, 0.2)}}
    assert served_summed([{}]) == {"samples": 0, "rows": 0, "bytes": 0, "retries": 0, "failovers": 0, "hedges_sent": 0,
                                   "hedges_won": 0, "taken_out": [], "replicas": {}}


def test_flat_keeps_numbers_and_names_each_replica_by_host_and_port():
    metrics = {"samples": 3, "collect_wait_s": 0.5, "on": True, "name": "x", "taken_out": [A, B],
               "replicas": {A: replica(2, 0, 0.1, None), B: replica(1, 1, None, None)}, "teachers": {0: {}}}
    assert flat(metrics) == {"teacher/samples": 3, "teacher/collect_wait_s": 0.5, "teacher/taken_out": 2,
                             "teacher/replica/a:8000/requests": 2, "teacher/replica/a:8000/failed": 0,
                             "teacher/replica/a:8000/latency_p50_s": 0.1, "teacher/replica/b:9000/requests": 1,
                             "teacher/replica/b:9000/failed": 1}
    assert flat({"samples": 1}, prefix="t/") == {"t/samples": 1, "t/taken_out": 0}
    # a key that is no number before one that is; a URL's path holding '://', a host ending in X, no scheme
    odd = {"on": True, "samples": 1, "replicas": {"http://a:8000/x://y": {"requests": 1}, "http://boX/": {"failed": 2},
                                                  "c:7000": {"requests": 3}}}
    assert flat(odd) == {"teacher/samples": 1, "teacher/taken_out": 0, "teacher/replica/a:8000/x://y/requests": 1,
                         "teacher/replica/boX/failed": 2, "teacher/replica/c:7000/requests": 3}


def test_fixed_figures_have_the_same_float_keys_on_every_rank():
    one = {"samples": 2, "rows": 6, "collect_s": 0.5, "bytes": 10, "taken_out": [A],
           "replicas": {A: replica(3, 0, 0.1, 0.4), B: replica(1, 0, 0.2, None)}}
    two = {"samples": 1, "scored_before": 1, "collect_wait_s": 0.25, "retries": 2, "taken_out": [B]}
    got = fixed_figures([one, two])
    expected = dict.fromkeys(FIXED_COUNTS, 0.0)
    expected.update({"samples": 3.0, "rows": 6.0, "scored_before": 1.0, "collect_s": 0.5, "collect_wait_s": 0.25,
                     "bytes": 10.0, "retries": 2.0, "taken_out": 2.0, "latency_p50_s": 0.2, "latency_p95_s": 0.4})
    assert got == expected and all(type(value) is float for value in got.values())
    nothing = fixed_figures([{}])
    assert nothing == {**dict.fromkeys(FIXED_COUNTS, 0.0), "taken_out": 0.0, "latency_p50_s": 0.0,
                       "latency_p95_s": 0.0} and all(type(value) is float for value in nothing.values())
