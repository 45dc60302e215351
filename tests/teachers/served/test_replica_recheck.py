"""A replica in use is probed again between steps (issue 86 item 1's last sentence): a server
restarted behind the same URL with other weights is found at the first step `ReplicaSettings(
recheck_s=...)` seconds after its last check, taken out before that step sends it a sample (named
in a warning), and the step is scored by the replicas that still agree; None or 0 turns it off.
Endpoints in memory (`memory_endpoints`: `offset` is another checkpoint's scores)."""
from __future__ import annotations

import logging
import time

import pytest
import torch

from megatron_rl_patches.teachers import ReplicaSettings, ServedTeacherError
from megatron_rl_patches.teachers.served.endpoint import SampleAsk, Step
from megatron_rl_patches.teachers.served.pool import SAME, ReplicaPool
from tests.teachers.served.memory_endpoints import MODEL, MemoryEndpoint, rows_of

LOGGER = "megatron_rl_patches.teachers.served"
RECHECK_S = 0.05
OTHER = ("replica http://b scores the probe other than replica http://a: its log-probs are off by 0.5 nats, beyond "
         "0.001 (another checkpoint, or the same in another precision)")


def connect(pool: ReplicaPool) -> None:
    step = Step.within(5)
    pool.served_model(step.deadline, step.cancel)


def step_of(pool: ReplicaPool, samples: int = 6) -> list:
    """One step of `samples` samples (all asked before any is waited for), their answers."""
    step = Step.within(10)
    asked = [pool.ask(MODEL, SampleAsk([i, 1, 2, 5, 3, 4], 3, i), step) for i in range(samples)]
    return [future.result(10) for future in asked]


def reference(samples: int = 6) -> list:
    return [rows_of([i, 1, 2, 5, 3, 4], 3) for i in range(samples)]


def same(got: list, want: list) -> bool:
    return all(torch.equal(g.token_log_probs, w.token_log_probs) and torch.equal(g.topk_log_probs, w.topk_log_probs)
               for g, w in zip(got, want, strict=True))


def warned(caplog) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]


def test_a_replica_restarted_with_other_weights_between_steps_is_taken_out_before_the_next(caplog):
    a, b = MemoryEndpoint("http://a"), MemoryEndpoint("http://b")
    pool = ReplicaPool([a, b], ReplicaSettings(hedge_after=None, recheck_s=RECHECK_S))
    connect(pool)
    assert same(step_of(pool), reference()) and b.asked, "both replicas score the first step"
    b.offset = 0.5  # restarted behind the same URL with another checkpoint
    time.sleep(2 * RECHECK_S)
    before = len(b.asked)
    warning = f"served teacher http://a|http://b: {OTHER}: taken out (asked again next step); {SAME}"
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        got = step_of(pool)
        until = time.monotonic() + 5
        while warning not in warned(caplog) and time.monotonic() < until:
            time.sleep(0.005)  # b's check may end after the step, which a scored alone meanwhile
    assert same(got, reference()), "the second step mixed the other checkpoint's scores"
    assert b.asked[before:] == [], "b got samples after its weights changed"
    assert warning in warned(caplog)
    for _ in range(2):  # still out at the next steps (re-checked, never sent a sample)
        time.sleep(2 * RECHECK_S)
        assert same(step_of(pool), reference()) and b.asked[before:] == []
    b.offset = 0.0  # back with the teacher's weights: in again after its next check
    until = time.monotonic() + 5
    while not b.asked[before:] and time.monotonic() < until:  # a step's samples go to the first check back
        time.sleep(2 * RECHECK_S)
        assert same(step_of(pool), reference())
    assert b.asked[before:], "b agrees again but got no sample"
    pool.close()


def test_the_first_replica_restarted_is_judged_against_the_teachers_probe_not_its_own():
    a, b = MemoryEndpoint("http://a"), MemoryEndpoint("http://b")
    pool = ReplicaPool([a, b], ReplicaSettings(hedge_after=None, recheck_s=RECHECK_S))
    connect(pool)
    step_of(pool)
    a.offset = 0.5  # the replica the teacher's probe came from
    time.sleep(2 * RECHECK_S)
    before = len(a.asked)
    assert same(step_of(pool), reference()) and a.asked[before:] == []
    pool.close()


def test_every_replica_changed_fails_the_step_naming_each():
    a, b = MemoryEndpoint("http://a"), MemoryEndpoint("http://b")
    pool = ReplicaPool([a, b], ReplicaSettings(hedge_after=None, recheck_s=RECHECK_S))
    connect(pool)
    step_of(pool)
    a.offset = b.offset = 0.5  # both restarted with another checkpoint: the teacher is not the one connected
    time.sleep(2 * RECHECK_S)
    with pytest.raises(ServedTeacherError) as raised:
        step_of(pool, 1)
    said = str(raised.value)
    assert "every one of the teacher's 2 replicas failed this step" in said
    assert "replica http://a scores the probe other than replica http://a" in said and OTHER in said
    pool.close()


def test_no_replica_is_probed_again_within_recheck_s():
    a, b = MemoryEndpoint("http://a"), MemoryEndpoint("http://b")
    pool = ReplicaPool([a, b], ReplicaSettings(hedge_after=None, recheck_s=600.0))
    connect(pool)
    for _ in range(3):
        step_of(pool)
    assert (a.checks, b.checks) == (1, 1)  # at connect only
    pool.close()


@pytest.mark.parametrize("off", [None, 0, 0.0])
def test_none_or_zero_turns_the_recheck_off(off):
    a, b = MemoryEndpoint("http://a"), MemoryEndpoint("http://b")
    pool = ReplicaPool([a, b], ReplicaSettings(hedge_after=None, recheck_s=off))
    connect(pool)
    step_of(pool)
    b.offset = 0.5
    time.sleep(2 * RECHECK_S)
    step_of(pool)
    assert (a.checks, b.checks) == (1, 1)
    pool.close()


def test_one_url_is_never_probed_again():
    only = MemoryEndpoint("http://a")
    pool = ReplicaPool([only], ReplicaSettings(hedge_after=None, recheck_s=RECHECK_S))
    connect(pool)
    for _ in range(2):
        time.sleep(2 * RECHECK_S)
        step_of(pool, 2)
    assert only.checks == 1
    pool.close()


def test_a_replica_down_at_its_recheck_is_taken_out_and_the_step_goes_on(caplog):
    a, b = MemoryEndpoint("http://a"), MemoryEndpoint("http://b")
    pool = ReplicaPool([a, b], ReplicaSettings(hedge_after=None, recheck_s=RECHECK_S))
    connect(pool)
    step_of(pool)
    b.fails = lambda sample: ServedTeacherError("http://b/v1/models: no answer after 2 tries (ConnectError)",
                                                "http://b", sample.index)
    time.sleep(2 * RECHECK_S)
    before = len(b.asked)
    warning = ("served teacher http://a|http://b: replica http://b taken out at its re-check (http://b/v1/models: no "
               "answer after 2 tries (ConnectError)); its samples go to the others, and it is asked again next step")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert same(step_of(pool), reference())
        until = time.monotonic() + 5
        while warning not in warned(caplog) and time.monotonic() < until:
            time.sleep(0.005)
    assert b.asked[before:] == []
    assert warning in warned(caplog)
    pool.close()


@pytest.mark.parametrize("value", [-1, -0.5, float("nan"), float("inf"), 1e300, 10**400, "60", True],
                         ids=["-1", "-0.5", "nan", "inf", "1e300", "10**400", "a string", "a bool"])
def test_a_bad_recheck_s_is_refused_naming_it(value):
    with pytest.raises((ValueError, TypeError), match=r"ReplicaSettings\(recheck_s="):
        ReplicaSettings(recheck_s=value)


def test_recheck_s_defaults_to_a_minute():
    assert ReplicaSettings().recheck_s == 60.0


def test_a_text_is_tokenized_while_every_replica_is_being_checked():
    a, b = MemoryEndpoint("http://a", hold=True), MemoryEndpoint("http://b", hold=True)
    pool = ReplicaPool([a, b], ReplicaSettings(hedge_after=None, recheck_s=RECHECK_S))
    connect(pool)
    time.sleep(2 * RECHECK_S)
    a.fails = b.fails = lambda sample: (time.sleep(0.5), None)[1]  # both checks slow: both being checked
    step = Step.within(10)
    pending = pool.ask(MODEL, SampleAsk([0, 1, 2, 5, 3, 4], 3, 0), step)
    assert pool.tokenize(MODEL, "w3 w4", step.deadline, step.cancel) == [3, 4]
    a.release(), b.release()
    assert same([pending.result(10)], reference(1))
    pool.close()
