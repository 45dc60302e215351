"""verl's `teacher/...` figures (`integrations.verl.teacher_metrics`) in one process, without verl:
an agent-loop worker's served teachers read once and summed (`worker_figures`), carried on its
output's first per-sample metrics dict and `None` on the others (`generate_sequences_wrapper`, only
with MEGATRON_RL_PATCHES_VERL_TEACHER set), and the manager's timing dict given the workers' sums
flat (`performance_metrics_wrapper`), verl's own result untouched where there is nothing to add.
verl's output is stood in (its `meta_info`), each teacher's `metrics()` a fixed dict. verl 0.9.1's
real agent loop, manager and trainer metrics: `lane/test_verl_teacher_metrics.py` (the verl lane)."""
from __future__ import annotations

import asyncio
import types

import pytest

from megatron_rl_patches.integrations.verl.teacher_metrics import (
    KEY,
    generate_sequences_wrapper,
    performance_metrics_wrapper,
    worker_figures,
)

VARIABLE = "MEGATRON_RL_PATCHES_VERL_TEACHER"


def figures(samples: int, url: str, p95: float | None) -> dict:
    """A served teacher's `metrics()` as the client writes it."""
    return {"samples": samples, "rows": 10 * samples, "bytes": 100 * samples, "retries": 1, "failovers": 0,
            "hedges_sent": 2, "hedges_won": 1, "taken_out": [url],
            "replicas": {url: {"requests": samples, "failed": 1, "latency_p50_s": 0.5, "latency_p95_s": p95}}}


class Teacher:
    """A served teacher as the worker's client holds it: its figures since the last read, read once."""

    def __init__(self, metrics: dict) -> None:
        self.reads, self.figures = 0, metrics

    def metrics(self) -> dict:
        self.reads += 1
        return self.figures


def worker_with(teachers: dict | None) -> types.SimpleNamespace:
    """An agent-loop worker whose teacher client holds `teachers` (as `held` keeps them)."""
    client = types.SimpleNamespace() if teachers is None else \
        types.SimpleNamespace(megatron_rl_patches_served_teachers=teachers)
    return types.SimpleNamespace(teacher_server_manager=client)


SUMMED = {"samples": 5, "rows": 50, "bytes": 500, "retries": 2, "failovers": 0, "hedges_sent": 4, "hedges_won": 2,
          "taken_out": ["a:1", "b:2"],
          "replicas": {"a:1": {"requests": 2, "failed": 1, "latency_p50_s": 0.5, "latency_p95_s": 0.75},
                       "b:2": {"requests": 3, "failed": 1, "latency_p50_s": 0.5, "latency_p95_s": None}}}


def test_a_workers_served_teachers_are_read_once_and_summed():
    one, two = Teacher(figures(2, "a:1", 0.75)), Teacher(figures(3, "b:2", None))
    assert worker_figures(worker_with({"x": one, "y": two})) == SUMMED
    assert (one.reads, two.reads) == (1, 1)
    for worker in (types.SimpleNamespace(), worker_with(None), worker_with({})):  # no client, none held, empty
        assert worker_figures(worker) is None


def output_of(metrics: object) -> types.SimpleNamespace:
    return types.SimpleNamespace(meta_info={"metrics": metrics})


def test_the_figures_ride_on_the_first_samples_metrics_only_with_the_variable(monkeypatch):
    worker = worker_with({"x": Teacher(figures(2, "a:1", 0.75))})
    made = output_of([{"generate_sequences": 0.1}, {"generate_sequences": 0.2}])

    called: list = []

    async def generate_sequences(batch, **kwargs):
        called.append((batch, kwargs))
        return made

    monkeypatch.setenv(VARIABLE, "http://teacher;engine=vllm")
    got = asyncio.run(generate_sequences_wrapper(generate_sequences, worker, ("batch",), {"validate": True}))
    assert called == [("batch", {"validate": True})]  # verl's call with its own arguments
    assert got is made and made.meta_info["metrics"] == [
        {"generate_sequences": 0.1, KEY: worker_figures(worker_with({"x": Teacher(figures(2, "a:1", 0.75))}))},
        {"generate_sequences": 0.2, KEY: None}]
    for metrics in ([], None, {"not": "a list"}):  # nothing per sample: nothing added, nothing read
        reader = Teacher(figures(1, "a:1", None))
        same = output_of(metrics)

        async def plain(batch, same=same):
            return same
        assert asyncio.run(generate_sequences_wrapper(plain, worker_with({"x": reader}), ("batch",), {})) is same
        assert same.meta_info["metrics"] == metrics and reader.reads == 0
    for unset in (None, "  "):  # unset or blank: verl's own call, as it is (no coroutine of ours around it)
        if unset is None:
            monkeypatch.delenv(VARIABLE)
        else:
            monkeypatch.setenv(VARIABLE, unset)
        worker = worker_with({})  # the variable is read once per worker, at its door (`verl_teacher`)
        assert generate_sequences_wrapper(lambda *a, **k: (a, k), worker, ("batch",), {"x": 1}) == (("batch",),
                                                                                                  {"x": 1})


def performance(metrics, output):
    """verl's `AgentLoopManager._performance_metrics(metrics, output)`: its timing dict."""
    return {"agent_loop/generate_sequences/max": 0.25}


def test_the_managers_timing_gets_the_workers_sums_flat():
    first, second = figures(2, "a:1", 0.75), figures(3, "b:2", None)
    chunks = [[{KEY: first, "generate_sequences": 0.1}, {KEY: None}], [{KEY: second}, "not a dict"]]
    timing = performance_metrics_wrapper(performance, None, (chunks, "output"), {})
    assert timing == {"agent_loop/generate_sequences/max": 0.25, "teacher/samples": 5, "teacher/rows": 50,
                      "teacher/bytes": 500, "teacher/retries": 2, "teacher/failovers": 0, "teacher/hedges_sent": 4,
                      "teacher/hedges_won": 2, "teacher/taken_out": 2,
                      "teacher/replica/a:1/requests": 2, "teacher/replica/a:1/failed": 1,
                      "teacher/replica/a:1/latency_p50_s": 0.5, "teacher/replica/a:1/latency_p95_s": 0.75,
                      "teacher/replica/b:2/requests": 3, "teacher/replica/b:2/failed": 1,
                      "teacher/replica/b:2/latency_p50_s": 0.5}
    assert performance_metrics_wrapper(performance, None, (), {"metrics": chunks, "output": None}) == timing


@pytest.mark.parametrize("chunks", [[[{KEY: None}, {"generate_sequences": 0.1}]], [], None],
                         ids=["no-figures", "no-chunks", "none"])
def test_the_managers_timing_is_verls_own_where_no_worker_read_a_teacher(chunks):
    assert performance_metrics_wrapper(performance, None, (chunks, "output"), {}) == \
        {"agent_loop/generate_sequences/max": 0.25}


def test_verls_result_is_handed_back_where_it_is_no_dict_or_names_no_metrics():
    chunks = [[{KEY: figures(1, "a:1", None)}]]
    assert performance_metrics_wrapper(lambda metrics, output: None, None, (chunks, "output"), {}) is None
    calls = []

    def other(*args, **kwargs):  # a fork's method without verl's `metrics` parameter: its result as it is
        calls.append((args, kwargs))
        return {"own": 1.0}
    assert performance_metrics_wrapper(other, None, (chunks,), {"extra": 2}) == {"own": 1.0}
    assert calls == [((chunks,), {"extra": 2})]
