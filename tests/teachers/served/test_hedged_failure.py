"""A replica lost under the default settings (hedging on), as a new user meets it (issue 96 item 0):
its requests fail only after the client's retries (seconds), a hedge to the live replica answers
first and stops them — and the failure those stopped requests report is the replica failing,
whoever answered the sample: one warning naming it, its samples counted as failed over, listed
in `taken_out`, and the next step asks only the live one. Endpoints in memory (the scheduler's);
the same through HTTP stand-ins: tests/teachers/served/test_served_metrics.py."""
from __future__ import annotations

import logging
import time

from megatron_rl_patches.teachers import ReplicaSettings
from megatron_rl_patches.teachers.served.endpoint import SampleAsk, Step
from megatron_rl_patches.teachers.served.metrics import Recorder
from megatron_rl_patches.teachers.served.pool import ReplicaPool
from tests.teachers.served.memory_endpoints import MODEL, MemoryEndpoint, failing, rows_of

LOGGER = "megatron_rl_patches.teachers.served"
RETRIES_S = 30.0  # a dead replica's request fails after the client's retries: long past the hedging point


def sample(index: int) -> SampleAsk:
    return SampleAsk([index, 1, 2, 5, 3, 4], 3, index)


def step_of(pool: ReplicaPool, count: int = 4) -> list:
    step = Step.within(60.0)
    return [future.result(20) for future in [pool.ask(MODEL, sample(i), step) for i in range(count)]]


def dies(endpoint: MemoryEndpoint) -> None:
    """The replica's server gone: each request fails after the retries, or at once when stopped."""
    endpoint.fails, endpoint.delay, endpoint.retrying = failing(endpoint.url), RETRIES_S, True


def settled(pool: ReplicaPool, replica: MemoryEndpoint, checks: int) -> None:
    """Wait (up to 20 s) until `replica` was re-checked `checks` times and no check is running."""
    until = time.monotonic() + 20
    while (replica.checks < checks or pool.scheduler.checking) and time.monotonic() < until:
        time.sleep(0.01)


def test_a_replica_lost_under_default_settings_is_taken_out_counted_and_named_once(caplog):
    a, b = MemoryEndpoint("http://a"), MemoryEndpoint("http://b")
    recorder = Recorder()
    pool = ReplicaPool([a, b], ReplicaSettings(), recorder)  # the defaults: hedging on
    step_of(pool)
    assert recorder.take()["taken_out"] == [] and a.asked and b.asked  # both answered step 0
    dies(b)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        got = step_of(pool)  # b's samples hedged to a at hedge_floor_s; b's requests stopped, failing
    assert [row.token_log_probs.tolist() for row in got] == \
        [rows_of(sample(i).ids, 3).token_log_probs.tolist() for i in range(4)]
    figures = recorder.take()
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "replica http://b taken out" in warned[0], warned
    lost = figures["replicas"]["http://b"]  # b's requests (fewest in flight: a answered at once, so b got one)
    assert figures["taken_out"] == ["http://b"] and lost["failed"] == lost["requests"] >= 1, str(figures)
    assert figures["failovers"] == figures["hedges_won"] == lost["failed"], str(figures)  # each answered by a
    asked = len(b.asked)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        step_of(pool)  # b re-checked in the background (still down: out), every sample to a
        step_of(pool)
        settled(pool, b, checks=2)
    assert len(b.asked) == asked and b.checks == 2, (b.asked, b.checks)
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]  # out for the same reason: said once
    after = recorder.take()
    assert after["failovers"] == after["hedges_sent"] == 0 and after["taken_out"] == []
    pool.close()

