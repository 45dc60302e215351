"""`ServedTeacher.metrics()` (issue 88 item 4, the client's half): what the teacher did since the
last call — samples, rows, bytes, retries, failovers, hedges sent and won, the replicas taken out,
and per replica (its redacted URL) its requests, failures and latency p50 / p95 — and a replica
taken out named in one warning line the first time in a step. In-memory endpoints (the scheduler's
counts) and a stand-in server killed mid-step (the whole teacher)."""
from __future__ import annotations

import logging

import pytest
import torch

from megatron_rl_patches.teachers import ClientSettings, ReplicaSettings, ServedTeacher, TeacherBatch
from megatron_rl_patches.teachers.served.endpoint import SampleAsk, Step
from megatron_rl_patches.teachers.served.metrics import Recorder, percentile
from megatron_rl_patches.teachers.served.pool import ReplicaPool
from tests.teachers.local_servers import dies_after, url_of, vllm_like
from tests.teachers.served.memory_endpoints import MODEL, MemoryEndpoint, failing

pytest.importorskip("httpx", reason="the served extra (httpx) is missing")

LOGGER = "megatron_rl_patches.teachers.served"


def sample(index: int) -> SampleAsk:
    return SampleAsk([index, 1, 2, 5, 3, 4], 3, index)


def test_hedges_sent_and_won_and_each_replicas_latency():
    slow, fast = MemoryEndpoint("http://slow", delay=2.0), MemoryEndpoint("http://fast", delay=0.01)
    recorder = Recorder()
    pool = ReplicaPool([slow, fast], ReplicaSettings(hedge_after=3.0, hedge_floor_s=0.1), recorder)
    pool.ask(MODEL, sample(0), Step.within(30)).result(10)  # to the slow one (its turn), hedged to the idle fast one
    got = recorder.take()
    assert (got["samples"], got["rows"], got["hedges_sent"], got["hedges_won"]) == (1, 3, 1, 1)
    assert got["replicas"]["http://fast"]["requests"] == 1 and got["replicas"]["http://fast"]["latency_p50_s"] < 1
    assert "http://slow" not in got["replicas"]  # its answer came after the step's: not counted
    again = recorder.take()
    assert again["samples"] == 0 and again["replicas"] == {} and again["taken_out"] == []


def test_a_failing_replica_is_counted_failed_over_and_taken_out_once():
    a, b = MemoryEndpoint("http://a"), MemoryEndpoint("http://b", fails=failing("http://b"))
    recorder = Recorder()
    pool = ReplicaPool([b, a], ReplicaSettings(hedge_after=None), recorder)
    step = Step.within(30)
    for future in [pool.ask(MODEL, sample(i), step) for i in range(4)]:
        future.result(10)
    got = recorder.take()
    assert got["samples"] == 4 and got["failovers"] == 1 and got["taken_out"] == ["http://b"]
    assert got["replicas"]["http://b"] == {"requests": 1, "failed": 1, "latency_p50_s": None, "latency_p95_s": None}
    assert got["replicas"]["http://a"]["requests"] == 4


def test_percentiles_are_nearest_rank():
    assert (percentile(list(range(1, 11)), 0.5), percentile(list(range(1, 11)), 0.95)) == (5, 10)
    assert percentile([], 0.5) is None and percentile([0.25], 0.95) == 0.25


def test_a_replica_killed_mid_step_shows_in_the_metrics_and_one_warning(caplog):
    batch = TeacherBatch([torch.tensor([i, 1, 2, 5, 3, 4]) for i in range(8)], [3] * 8)
    settings = ClientSettings(retries=1, backoff_s=0.01, deadline_s=20.0)
    with vllm_like() as a, vllm_like(v1_completions=dies_after(2)) as b, \
            ServedTeacher([url_of(a), url_of(b)], top_k=2, client=settings,
                          replicas=ReplicaSettings(hedge_after=None)) as teacher:
        teacher.check()  # the probe: b's first answer
        assert teacher.metrics()["taken_out"] == []  # the connect's figures, read and dropped
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            teacher.score(batch)  # b answers one sample, then dies with others in flight
        step = teacher.metrics()
        teacher.score(batch)
        after = teacher.metrics()
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and url_of(b) in r.getMessage()]
    assert len(warned) == 1 and "taken out" in warned[0], warned
    assert step["samples"] == 8 and step["rows"] == 24 and step["bytes"] > 0
    assert step["taken_out"] == [url_of(b)] and step["failovers"] >= 1 and step["retries"] >= 1
    assert step["replicas"][url_of(b)]["failed"] >= 1 and step["replicas"][url_of(a)]["latency_p95_s"] is not None
    assert after["samples"] == 8 and after["taken_out"] == [] and after["failovers"] == 0  # b stays out: not again


def test_a_replica_killed_under_the_default_settings_is_taken_out_and_named_once(caplog):
    """Issue 96 item 0 through HTTP: the default client and replica settings (retries with backoff,
    hedging on). b dies after step 1: its request is in its retries when the hedge to a answers,
    and that request's failure takes b out all the same — one warning, counted, the next step on a
    alone (it had stayed in, hedged every step)."""
    batch = TeacherBatch([torch.tensor([i, 1, 2, 5, 3, 4]) for i in range(8)], [3] * 8)  # some on b, surely
    with vllm_like() as a, vllm_like() as b, ServedTeacher([url_of(a), url_of(b)], top_k=2) as teacher:
        for _ in range(2):
            teacher.score(batch)
        assert teacher.metrics()["taken_out"] == []
        b.dead = True  # killed: every later request cut without a reply
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            teacher.score(batch)  # b's samples: reset, retried; hedged to a after hedge_floor_s
            step = teacher.metrics()
            teacher.score(batch)
            after = teacher.metrics()
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and url_of(b) in r.getMessage()]
    assert len(warned) == 1 and "taken out" in warned[0], warned
    assert step["taken_out"] == [url_of(b)] and step["failovers"] >= 1 and step["hedges_won"] >= 1, step
    # no sample of the next step went to b (one would have failed over); a stopped request of the step
    # before may end (failed) during it
    assert after["samples"] == 8 and after["failovers"] == after["hedges_sent"] == 0, after
