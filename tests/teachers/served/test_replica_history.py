"""Scheduling remembers across steps (issue 86 item 3): a replica taken out stays out until it is
re-checked (between steps, before it gets a sample again), so a dead replica does not cost every
step its retries; hedging reads the replicas' history, not the step's own answers, so a
one-sample step on [slow, fast] is hedged (before any history, to an idle replica); ties go round
the replicas across steps, so one-sample steps reach every replica. In-memory endpoints (fast,
deterministic) and stand-in servers."""
from __future__ import annotations

import time

import pytest
import torch

from megatron_rl_patches.teachers import ClientSettings, ReplicaSettings, ServedTeacher, TeacherBatch
from megatron_rl_patches.teachers.served.endpoint import SampleAsk, Step
from megatron_rl_patches.teachers.served.pool import ReplicaPool
from tests.teachers.local_servers import dies_after, url_of, vllm_like
from tests.teachers.served.memory_endpoints import MODEL, MemoryEndpoint, failing

pytest.importorskip("httpx", reason="the served extra (httpx) is missing")

NO_HEDGE = ReplicaSettings(hedge_after=None)


def one_sample_step(pool: ReplicaPool, index: int = 0, timeout: float = 10.0):
    return pool.ask(MODEL, SampleAsk([index, 1, 2, 5, 3, 4], 3, index), Step.within(30.0)).result(timeout)


def test_one_sample_steps_go_round_the_replicas():
    a, b = MemoryEndpoint("http://a"), MemoryEndpoint("http://b")
    pool = ReplicaPool([a, b], NO_HEDGE)
    pool.served_model(Step.within(5).deadline, Step.within(5).cancel)
    for i in range(6):
        one_sample_step(pool, i)
    assert (a.asked, b.asked) == ([0, 2, 4], [1, 3, 5])


def test_a_one_sample_step_on_a_slow_and_a_fast_replica_is_hedged():
    slow, fast = MemoryEndpoint("http://slow", delay=3.0), MemoryEndpoint("http://fast", delay=0.01)
    pool = ReplicaPool([slow, fast], ReplicaSettings(hedge_after=3.0, hedge_floor_s=0.2))
    took = []
    for i in range(4):
        start = time.monotonic()
        one_sample_step(pool, i)
        took.append(time.monotonic() - start)
    assert max(took) < 1.5, took  # the slow replica answers in 3 s: every step hedged to the fast one, or sent there
    assert fast.asked and len(fast.asked) >= 4


def test_a_replica_taken_out_stays_out_until_re_checked():
    dead, good = MemoryEndpoint("http://dead"), MemoryEndpoint("http://good")
    pool = ReplicaPool([dead, good], NO_HEDGE)
    pool.served_model(Step.within(5).deadline, Step.within(5).cancel)
    dead.fails = failing("http://dead")  # dies after connect
    for i in range(4):
        one_sample_step(pool, i)
    assert dead.asked == [0], dead.asked  # asked once; after that only re-checked (its card and probe), never a sample
    assert dead.checks >= 2 and good.asked == [0, 1, 2, 3]


def test_a_dead_replica_does_not_cost_every_step_its_retries():
    settings = ClientSettings(retries=3, backoff_s=0.4, deadline_s=30.0)
    batch = TeacherBatch([torch.tensor([0, 1, 2, 5, 3, 4])], [3])
    with vllm_like(v1_completions=dies_after(1)) as dead, vllm_like() as good, \
            ServedTeacher([url_of(dead), url_of(good)], top_k=2, client=settings,
                          replicas=ReplicaSettings(hedge_after=None)) as teacher:
        teacher.check()  # the probe: the first replica's one answer, then it dies
        took = []
        for _ in range(4):
            start = time.monotonic()
            teacher.score(batch)
            took.append(time.monotonic() - start)
    assert sum(took[1:]) < 1.5, took  # its retries (0.4 + 0.8 + 1.6 s) paid once, at most, not at every step


def test_the_history_lives_across_steps():
    slow, fast = MemoryEndpoint("http://slow", delay=0.3), MemoryEndpoint("http://fast")
    pool = ReplicaPool([slow, fast], ReplicaSettings(hedge_after=2.0, hedge_floor_s=0.01))
    for i in range(6):
        one_sample_step(pool, i)
    assert len(pool.scheduler.history) >= 3  # not forgotten at each step

