"""The replicas' scheduler (`served.scheduler.Scheduler`) in the cases its other tests pass by,
with endpoints in memory and re-checks told by hand where the order matters: each error matched
whole with its URL and sample (every replica failed, one replica's re-check failing with an error
of another kind, the step's cancel, a deadline with no replica asked), a sample asked after every
replica is out failing at once, an answered request no longer in flight, a waiting sample of a
prompt placed with its prompt, each replica asked by its own model name, several samples at their
deadline, the latest answer times only, and a watcher that does not keep the interpreter alive."""
from __future__ import annotations

import time

import pytest

from megatron_rl_patches.teachers import ReplicaSettings, ServedTeacherError
from megatron_rl_patches.teachers.served.endpoint import SampleAsk, Step
from megatron_rl_patches.teachers.served.engines.protocol import ServedModel
from megatron_rl_patches.teachers.served.metrics import Recorder
from megatron_rl_patches.teachers.served.pool import ReplicaPool
from megatron_rl_patches.teachers.served.scheduler import HISTORY, Scheduler
from megatron_rl_patches.teachers.served.spreading import PromptAffinity
from tests.teachers.served.memory_endpoints import MODEL, MemoryEndpoint, failing

NO_HEDGE = ReplicaSettings(hedge_after=None)
NO_ANSWER = "{}/v1/completions: no answer after 2 tries (ConnectError)"


def sample(index: int, prompt: int = 0) -> SampleAsk:
    return SampleAsk([prompt, 1, 2, 5, 3, 4], 3, index)


def told_by_hand(replicas: list[MemoryEndpoint], settings: ReplicaSettings) -> tuple[Scheduler, list[int]]:
    """A scheduler whose re-checks are only listed: the test tells their outcome (`rejoin`)."""
    asked: list[int] = []
    url = "|".join(replica.url for replica in replicas)
    return Scheduler(replicas, settings, url, lambda index, step, in_use: asked.append(index), Recorder()), asked


def test_every_replica_failed_is_one_error_naming_each_in_order():
    a, b = MemoryEndpoint("http://a", fails=failing("http://a")), MemoryEndpoint("http://b", fails=failing("http://b"))
    with pytest.raises(ServedTeacherError) as raised:
        ReplicaPool([a, b], NO_HEDGE).ask(MODEL, sample(3), Step.within(30.0)).result(5)
    assert (raised.value.url, raised.value.sample) == ("http://a|http://b", 3)
    assert str(raised.value) == ("http://a|http://b (sample 3): every one of the teacher's 2 replicas failed this step "
                                 "(each is asked again next step): "
                                 f"{NO_ANSWER.format('http://a')}; {NO_ANSWER.format('http://b')}")


def test_a_sample_asked_once_every_replica_is_out_fails_at_once_with_the_error():
    a = MemoryEndpoint("http://a", fails=failing("http://a"))
    pool = ReplicaPool([a], NO_HEDGE)
    step = Step.within(30.0)
    with pytest.raises(ServedTeacherError):
        pool.ask(MODEL, sample(0), step).result(5)  # a taken out for the step
    start = time.monotonic()
    with pytest.raises(ServedTeacherError) as raised:
        pool.ask(MODEL, sample(1), step).result(5)  # nothing to send it to, nothing re-checked: no wait
    assert time.monotonic() - start < 2.0 and a.asked == [0]
    assert str(raised.value) == NO_ANSWER.format("http://a")


def test_a_re_check_failing_with_another_kind_of_error_is_the_samples_served_teacher_error():
    a = MemoryEndpoint("http://a", fails=failing("http://a"))
    pool = ReplicaPool([a], NO_HEDGE)
    with pytest.raises(ServedTeacherError):
        pool.ask(MODEL, sample(0), Step.within(30.0)).result(5)
    a.fails = lambda _sample: OSError("the replica's disk is gone")  # its re-check, next step
    with pytest.raises(ServedTeacherError) as raised:
        pool.ask(MODEL, sample(1), Step.within(30.0)).result(5)
    assert (str(raised.value), raised.value.url, raised.value.sample) == ("the replica's disk is gone", "http://a", 1)
    pool.close()


def test_the_steps_cancel_fails_its_sample_with_the_url_and_sample():
    a = MemoryEndpoint("http://a", hold=True)
    pool = ReplicaPool([a], NO_HEDGE)
    step = Step.within(30.0)
    future = pool.ask(MODEL, sample(4), step)
    step.cancel.set()
    with pytest.raises(ServedTeacherError) as raised:
        future.result(5)
    assert (str(raised.value), raised.value.url, raised.value.sample) == (
        "http://a: sample 4 not answered: the step failed before", "http://a", 4)
    pool.close()


def test_a_sample_waiting_for_a_re_check_at_its_deadline_names_no_replica_asked():
    a = MemoryEndpoint("http://a")
    scheduler, rechecked = told_by_hand([a], NO_HEDGE)
    scheduler.connected({}, {0: ServedTeacherError(NO_ANSWER.format("http://a"), "http://a")})
    with pytest.raises(ServedTeacherError) as raised:
        scheduler.ask(MODEL, sample(2), Step.within(0.3)).result(5)  # its re-check never answers
    assert rechecked == [0] and a.asked == []
    assert str(raised.value) == "http://a (sample 2): no reply within the step's deadline of 0.3 s (asked: none)"
    scheduler.close()


def test_several_samples_in_flight_each_fail_at_the_deadline():
    a = MemoryEndpoint("http://a", hold=True)
    pool = ReplicaPool([a], NO_HEDGE)
    step = Step.within(0.3)
    futures = [pool.ask(MODEL, sample(i), step) for i in range(3)]
    for i, future in enumerate(futures):
        with pytest.raises(ServedTeacherError) as raised:
            future.result(5)
        assert str(raised.value) == (f"http://a (sample {i}): no reply within the step's deadline of 0.3 s "
                                     "(asked: http://a)")
    pool.close()


def test_an_answered_request_is_no_longer_in_flight():
    """Fewest in flight: a held on sample 0, b answers sample 1 at once, so sample 2 goes to b
    (its answered request no longer counts), not round to a."""
    a, b = MemoryEndpoint("http://a", hold=True), MemoryEndpoint("http://b")
    pool = ReplicaPool([a, b], NO_HEDGE)
    step = Step.within(30.0)
    futures = [pool.ask(MODEL, sample(i), step) for i in range(3)]
    assert (a.asked, b.asked) == ([0], [1, 2]) and pool.scheduler.in_flight == [1, 0]
    a.release()
    for future in futures:
        future.result(5)
    assert pool.scheduler.in_flight == [0, 0]
    pool.close()


def test_samples_waiting_for_a_re_check_are_placed_with_their_prompt():
    """Prompt affinity across a re-check: samples of one prompt that waited go to the replica back
    first, and that replica stays the prompt's home once the other is back too."""
    a, b = MemoryEndpoint("http://a"), MemoryEndpoint("http://b")
    scheduler, rechecked = told_by_hand([a, b], ReplicaSettings(spread=PromptAffinity(), hedge_after=None))
    scheduler.connected({}, {0: ServedTeacherError("a: down", "http://a"), 1: ServedTeacherError("b: down", "http://b")})
    step = Step.within(30.0)
    waited = [scheduler.ask(MODEL, sample(i, prompt=7), step) for i in range(2)]
    assert sorted(rechecked) == [0, 1] and (a.asked, b.asked) == ([], [])
    scheduler.rejoin(1, MODEL, None)
    scheduler.rejoin(0, MODEL, None)
    later = scheduler.ask(MODEL, sample(2, prompt=7), step)
    for future in [*waited, later]:
        future.result(5)
    assert (a.asked, b.asked) == ([], [0, 1, 2])
    scheduler.close()


class ModelNames(MemoryEndpoint):
    """A replica that notes the served model each request asks."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.models: list[ServedModel] = []

    def ask(self, model, sample, step):
        self.models.append(model)
        return super().ask(model, sample, step)


def test_each_replica_is_asked_by_its_own_model_else_the_teachers():
    a, b = ModelNames("http://a"), ModelNames("http://b")
    own = ServedModel("b-own-name", 64)
    scheduler, _ = told_by_hand([a, b], NO_HEDGE)
    scheduler.connected({1: own}, {})
    step = Step.within(30.0)
    for i in range(2):
        scheduler.ask(MODEL, sample(i), step).result(5)
    assert (a.models, b.models) == ([MODEL], [own])
    scheduler.close()


def test_the_hedging_point_reads_the_latest_answer_times_only():
    a = MemoryEndpoint("http://a")
    pool = ReplicaPool([a], NO_HEDGE)
    for i in range(HISTORY + 3):
        pool.ask(MODEL, sample(i), Step.within(30.0)).result(5)
    assert HISTORY == 64 and len(pool.scheduler.history) == HISTORY
    pool.close()


def test_the_watcher_does_not_keep_the_interpreter_alive():
    """A teacher left unclosed must not hang the trainer's exit: the watcher is a daemon thread."""
    pool = ReplicaPool([MemoryEndpoint("http://a")], NO_HEDGE)
    pool.ask(MODEL, sample(0), Step.within(30.0)).result(5)
    assert pool.scheduler.watcher is not None and pool.scheduler.watcher.daemon
    pool.close()
