"""The scheduler's failover count and its waiting samples, with endpoints in memory and the order
told by hand (no hedging point, no timing): a sample whose requests fail on two replicas while a
third has it is one failover, not two; a sample whose replica fails while the only other one is
being re-checked waits for it and is answered there once it is back."""
from __future__ import annotations

import torch

from megatron_rl_patches.teachers import ReplicaSettings, ServedTeacherError
from megatron_rl_patches.teachers.served.endpoint import SampleAsk, Step
from megatron_rl_patches.teachers.served.metrics import Recorder
from megatron_rl_patches.teachers.served.scheduler import Scheduler
from tests.teachers.served.memory_endpoints import MODEL, MemoryEndpoint, failing, rows_of

NO_HEDGE = ReplicaSettings(hedge_after=None)
SAMPLE = SampleAsk([4, 1, 2, 5, 3, 4], 3, 0)


def scheduler_of(replicas: list[MemoryEndpoint], recorder: Recorder) -> tuple[Scheduler, list[int]]:
    """A scheduler whose re-checks are only listed: the test tells their outcome (`rejoin`)."""
    asked: list[int] = []
    url = "|".join(replica.url for replica in replicas)
    return Scheduler(replicas, NO_HEDGE, url, lambda index, step, in_use: asked.append(index), recorder), asked


def fails_now(replica: MemoryEndpoint) -> None:
    """The replica's held request (and every later one) fails."""
    replica.fails = failing(replica.url)
    replica.release()


def test_two_requests_failing_while_a_third_replica_has_the_sample_are_one_failover():
    a, b, c = (MemoryEndpoint(f"http://{name}", hold=True) for name in "abc")
    recorder = Recorder()
    scheduler, _ = scheduler_of([a, b, c], recorder)
    future = scheduler.ask(MODEL, SAMPLE, Step.within(30.0))
    (job,) = scheduler.jobs
    for _ in range(2):  # two more requests of the sample out (as hedges send them)
        with scheduler.lock:
            attempt = scheduler.reserve(job, None, hedge=True)
        assert attempt is not None
        scheduler.send(job, attempt)
    assert (a.asked, b.asked, c.asked) == ([0], [0], [0])
    fails_now(a)
    fails_now(b)
    c.release()
    got = future.result(5)
    figures = recorder.take()
    scheduler.close()
    assert torch.equal(got.token_log_probs, rows_of(SAMPLE.ids, SAMPLE.start).token_log_probs)
    assert figures["failovers"] == 1 and sorted(figures["taken_out"]) == ["http://a", "http://b"], str(figures)


def test_a_sample_whose_replica_fails_while_the_other_is_re_checked_waits_and_is_answered_there():
    a, b = MemoryEndpoint("http://a", fails=failing("http://a")), MemoryEndpoint("http://b")
    recorder = Recorder()
    scheduler, rechecked = scheduler_of([a, b], recorder)
    scheduler.connected({0: MODEL}, {1: ServedTeacherError("http://b: down", "http://b")})
    future = scheduler.ask(MODEL, SAMPLE, Step.within(30.0))  # to a (b re-checked); a fails: the sample waits
    assert rechecked == [1] and a.asked == [0] and b.asked == [] and not future.done()
    scheduler.rejoin(1, MODEL, None)  # b is back: the waiting sample goes there
    got = future.result(5)
    figures = recorder.take()
    scheduler.close()
    assert b.asked == [0] and torch.equal(got.token_log_probs, rows_of(SAMPLE.ids, SAMPLE.start).token_log_probs)
    assert figures["failovers"] == 1 and figures["taken_out"] == ["http://a"], str(figures)
