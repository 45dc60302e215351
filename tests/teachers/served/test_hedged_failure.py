"""A replica lost under the default settings (hedging on), as a new user meets it (issue 96 item 0):
its requests fail only after the client's retries (seconds), a hedge to the live replica answers
first and stops them — and the failure those stopped requests report is the replica failing,
whoever answered the sample: one warning naming it, its samples counted as failed over, listed
in `taken_out`, and the next step asks only the live one. Endpoints in memory (the scheduler's);
the same through HTTP stand-ins: tests/teachers/served/test_served_metrics.py."""
from __future__ import annotations

import logging
import time

import torch

from megatron_rl_patches.teachers import ReplicaSettings
from megatron_rl_patches.teachers.errors import ServedTeacherStopped
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



class Queued(MemoryEndpoint):
    """A healthy replica whose requests wait in its queue (its tokens in flight full) and, when the
    sample is answered elsewhere, end unsent: `Server.run`'s `ServedTeacherStopped`."""

    def ask(self, model, sample, step):
        future = super().ask(model, sample, step)  # held: never answered by itself
        step.cancel.on_set(lambda: future.done() or future.set_exception(
            ServedTeacherStopped(f"{self.url}: sample {sample.index} not sent", self.url, sample.index)))
        return future


def test_a_hedge_loser_stopped_in_its_queue_takes_its_healthy_replica_out_of_nothing(caplog):
    a, b = MemoryEndpoint("http://a"), Queued("http://b", hold=True)
    recorder = Recorder()
    pool = ReplicaPool([a, b], ReplicaSettings(hedge_after=2.0, hedge_floor_s=0.05), recorder)
    step = Step.within(30.0)
    pool.ask(MODEL, sample(0), step).result(5)  # a's answer: the step's first time
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        got = pool.ask(MODEL, sample(1), step).result(5)  # queued at b (its turn), hedged to a, answered there
    assert b.asked == [1] and b.cancels[0].is_set()  # b's request was stopped unsent
    assert torch.equal(got.token_log_probs, rows_of(sample(1).ids, 3).token_log_probs)
    time.sleep(0.1)  # the stopped request's end reaches the scheduler
    figures = recorder.take()
    assert figures["taken_out"] == [] and figures["failovers"] == 0 and not pool.scheduler.out, str(figures)
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]
    pool.close()


def test_the_server_ends_a_request_stopped_before_it_was_sent_as_stopped():
    """What `Queued` stands in for: `Server.run` of a request whose cancel was set while it waited."""
    from types import SimpleNamespace

    from megatron_rl_patches.teachers import ClientSettings
    from megatron_rl_patches.teachers.served.server import Server

    def never_sent(*args):
        raise AssertionError("a stopped request was sent")

    client = SimpleNamespace(url="http://q", close=lambda: None)
    engine = SimpleNamespace(client=client, kind="rows", tokenize_path="/tokenize", ask=never_sent)
    server = Server(engine, ClientSettings())  # type: ignore[arg-type]
    step = Step.within(30.0)
    step.cancel.set()
    error = server.ask(MODEL, sample(2), step).exception(5)
    server.close()
    assert isinstance(error, ServedTeacherStopped) and "sample 2 not sent" in str(error), error
