"""The replicas' scheduler against endpoints in memory (fast, deterministic): samples spread by
fewest in flight or kept with their prompt (the spreading policies), a failing replica taken out
for the step and its sample re-sent, a refusal raised as it is, a slow replica hedged (the first
answer wins, the other's request cancelled), every replica failed one error naming each, one
replica its own error, the deadline and the step's cancel ending a sample. The same over HTTP:
tests/teachers/test_served_replicas.py; against real vLLM servers: tests/teachers/lane."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from megatron_rl_patches.teachers import ReplicaSettings, ServedTeacherError, ServedTeacherRefusal
from megatron_rl_patches.teachers.served.endpoint import SampleAsk, Step
from megatron_rl_patches.teachers.served.pool import ReplicaPool
from megatron_rl_patches.teachers.served.spreading import FewestInFlight, PromptAffinity
from tests.teachers.served.memory_endpoints import MODEL, MemoryEndpoint, rows_of

NO_HEDGE = ReplicaSettings(hedge_after=None)


def sample(index: int, prompt: int = 0) -> SampleAsk:
    return SampleAsk([prompt, 1, 2, 5, 3, 4], 3, index)


def ask_all(pool: ReplicaPool, samples: list[SampleAsk], step: Step | None = None, timeout: float = 10.0) -> list:
    step = step or Step.within(30.0)
    futures = [pool.ask(MODEL, one, step) for one in samples]
    return [future.result(timeout) for future in futures]


def broken(url: str) -> ServedTeacherError:
    return ServedTeacherError(f"{url}/v1/completions: no answer after 2 tries (ConnectError)", url)


def test_samples_spread_by_fewest_in_flight_ties_round_the_replicas():
    a, b = MemoryEndpoint("http://a", hold=True), MemoryEndpoint("http://b", hold=True)
    pool = ReplicaPool([a, b], NO_HEDGE)
    step = Step.within(30.0)
    futures = [pool.ask(MODEL, sample(i), step) for i in range(8)]
    assert (a.asked, b.asked) == ([0, 2, 4, 6], [1, 3, 5, 7])
    a.release(), b.release()
    assert all(torch.equal(f.result(5).token_log_probs, rows_of(sample(0).ids, 3).token_log_probs) for f in futures)


def test_prompt_affinity_keeps_a_prompts_samples_on_one_replica():
    a, b = MemoryEndpoint("http://a"), MemoryEndpoint("http://b")
    # no hedging: a thread held past hedge_floor_s on a loaded machine hedged sample 0, whose tie turn then
    # sent the second prompt to a as well (CI: [[0], [0..7]]); what is tested is the spreading alone
    for settings in (ReplicaSettings(keep_prompt_groups=True, hedge_after=None),
                     ReplicaSettings(spread=PromptAffinity(), hedge_after=None)):
        a.asked, b.asked = [], []
        pool = ReplicaPool([a, b], settings)
        ask_all(pool, [sample(i, prompt=5 + i // 4) for i in range(8)])
        assert sorted([a.asked, b.asked]) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert ReplicaSettings(keep_prompt_groups=True) == ReplicaSettings(spread=PromptAffinity())
    assert ReplicaSettings().spread == FewestInFlight() and not ReplicaSettings().keep_prompt_groups
    with pytest.raises(ValueError, match="keep_prompt_groups=True is spread=PromptAffinity"):
        ReplicaSettings(keep_prompt_groups=True, spread=FewestInFlight())
    with pytest.raises(TypeError, match="spread=...\\) must be a spreading policy"):
        ReplicaSettings(spread="affinity")


def test_a_failing_replica_is_taken_out_for_the_step_and_its_sample_resent():
    a, b = MemoryEndpoint("http://a"), MemoryEndpoint("http://b", fails=lambda s: broken("http://b"))
    pool = ReplicaPool([a, b], NO_HEDGE)
    step = Step.within(30.0)
    got = ask_all(pool, [sample(i) for i in range(6)], step)
    assert b.asked == [1] and a.asked == [0, 1, 2, 3, 4, 5]  # out after its first failure, for the step
    assert all(torch.equal(g.token_log_probs, rows_of(sample(0).ids, 3).token_log_probs) for g in got)
    ask_all(pool, [sample(0), sample(1)])  # the next step re-checks it (in memory: it still fails), no sample
    assert b.asked == [1] and b.checks == 1


def test_a_refusal_is_the_requests_own_and_raised_as_it_is():
    refused = ServedTeacherRefusal("http://b/v1/completions (sample 0) refused the request: HTTP 400", "http://b", 0)
    a, b = MemoryEndpoint("http://a"), MemoryEndpoint("http://b", fails=lambda s: refused)
    pool = ReplicaPool([b, a], NO_HEDGE)
    with pytest.raises(ServedTeacherRefusal) as caught:
        pool.ask(MODEL, sample(0), Step.within(30.0)).result(5)
    assert caught.value is refused and a.asked == []


def test_a_slow_replica_is_hedged_and_the_first_answer_wins():
    a, b = MemoryEndpoint("http://a"), MemoryEndpoint("http://b", hold=True)
    pool = ReplicaPool([a, b], ReplicaSettings(hedge_after=2.0, hedge_floor_s=0.05))
    step = Step.within(30.0)
    ask_all(pool, [sample(0)], step)  # a's answer: the step's first time
    start = time.monotonic()
    got = pool.ask(MODEL, sample(1), step).result(5)  # sent to b (its turn), hedged to a
    assert time.monotonic() - start < 2.0 and b.asked == [1] and a.asked == [0, 1]
    assert torch.equal(got.token_log_probs, rows_of(sample(1).ids, 3).token_log_probs)
    assert b.cancels[0].is_set() and not step.cancel.is_set()  # the loser's request cancelled, not the step


def test_every_replica_failed_is_one_error_naming_each():
    a = MemoryEndpoint("http://a", fails=lambda s: broken("http://a"))
    b = MemoryEndpoint("http://b", fails=lambda s: broken("http://b"))
    with pytest.raises(ServedTeacherError, match="every one of the teacher's 2 replicas failed this step") as caught:
        ReplicaPool([a, b], NO_HEDGE).ask(MODEL, sample(3), Step.within(30.0)).result(5)
    assert "http://a/v1" in str(caught.value) and "http://b/v1" in str(caught.value) and caught.value.sample == 3


def test_one_replica_fails_with_its_own_error():
    error = broken("http://a")
    with pytest.raises(ServedTeacherError) as caught:
        ReplicaPool([MemoryEndpoint("http://a", fails=lambda s: error)], NO_HEDGE).ask(
            MODEL, sample(0), Step.within(30.0)).result(5)
    assert caught.value is error


def test_the_deadline_and_the_steps_cancel_end_a_sample():
    a = MemoryEndpoint("http://a", hold=True)
    pool = ReplicaPool([a], NO_HEDGE)
    start = time.monotonic()
    with pytest.raises(ServedTeacherError, match="\\(sample 0\\): no reply within the step's deadline of 0.3 s "
                                                 "\\(asked: http://a\\)"):
        pool.ask(MODEL, sample(0), Step.within(0.3)).result(5)
    assert time.monotonic() - start < 2.0 and a.cancels[0].is_set()
    step = Step.within(30.0)
    future = pool.ask(MODEL, sample(1), step)
    step.cancel.set()
    with pytest.raises(ServedTeacherError, match="sample 1 not answered: the step failed before"):
        future.result(5)
    assert a.cancels[1].is_set()


def test_the_watcher_sleeps_until_something_is_due():
    """Event-driven: a sample held for 0.5 s with hedging off wakes the pool's watcher a few
    times (each change), never on a clock tick."""
    a = MemoryEndpoint("http://a", hold=True)
    pool = ReplicaPool([a], NO_HEDGE)
    waits = []
    wait = pool.scheduler.changed.wait

    def counted(timeout=None):
        waits.append(timeout)
        return wait(timeout)

    pool.scheduler.changed.wait = counted  # type: ignore[method-assign]
    future = pool.ask(MODEL, sample(0), Step.within(30.0))
    threading.Timer(0.5, a.release).start()
    future.result(5)
    time.sleep(0.1)
    assert len(waits) <= 4, waits
    pool.close()
