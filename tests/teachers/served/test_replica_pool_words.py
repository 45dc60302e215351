"""What the replica pool (`served.pool.ReplicaPool`) says and hands on, matched whole, with
endpoints in memory: the connect warning naming each replica left out, the min_replicas error's
URL, a replica back with other weights refused with the pool's URL and warned of, the replicas'
tokenizers compared (the same ids, or the one that differs named), and `close` not waiting for a
re-check still out."""
from __future__ import annotations

import logging
import threading
import time

import pytest

from megatron_rl_patches.teachers import ReplicaSettings, ServedTeacherError, ServedTeacherRefusal
from megatron_rl_patches.teachers.served.endpoint import SampleAsk, Step
from megatron_rl_patches.teachers.served.pool import SAME, ReplicaPool
from tests.teachers.served.memory_endpoints import MemoryEndpoint, failing

LOGGER = "megatron_rl_patches.teachers.served"
NO_ANSWER = "{}/v1/completions: no answer after 2 tries (ConnectError)"


def connect(pool: ReplicaPool):
    step = Step.within(5)
    return pool.served_model(step.deadline, step.cancel)


def sample(index: int) -> SampleAsk:
    return SampleAsk([index, 1, 2, 5, 3, 4], 3, index)


def test_the_connect_warning_names_the_pool_and_each_replica_left_out(caplog):
    a, b, c = MemoryEndpoint("http://a"), MemoryEndpoint("http://b", fails=failing("http://b")), \
        MemoryEndpoint("http://c", fails=failing("http://c"))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        connect(ReplicaPool([a, b, c], ReplicaSettings(hedge_after=None)))
    (warning,) = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    assert warning == ("served teacher http://a|http://b|http://c: 2 of the teacher's 3 replicas did not answer at "
                       "connect; it starts with the others and asks these again between steps: "
                       f"{NO_ANSWER.format('http://b')}; {NO_ANSWER.format('http://c')}")


def test_fewer_than_min_replicas_is_an_error_of_the_pools_url():
    a, b = MemoryEndpoint("http://a"), MemoryEndpoint("http://b", fails=failing("http://b"))
    with pytest.raises(ServedTeacherError) as raised:
        connect(ReplicaPool([a, b], ReplicaSettings(min_replicas=2)))
    assert raised.value.url == "http://a|http://b"
    assert str(raised.value) == ("http://a|http://b: 1 of the teacher's 2 replicas answered at connect, fewer than "
                                 f"ReplicaSettings(min_replicas=2): {NO_ANSWER.format('http://b')}")


def test_a_replica_back_with_other_weights_is_refused_with_the_pools_url_and_warned_of(caplog):
    """One replica taken out by a failed sample, back with other weights: its re-check refuses it (the
    sample's error, as a single server's) and warns, naming what differs."""
    only = MemoryEndpoint("http://a")
    pool = ReplicaPool([only], ReplicaSettings(hedge_after=None))
    model = connect(pool)
    only.fails = failing("http://a")
    with pytest.raises(ServedTeacherError):
        pool.ask(model, sample(0), Step.within(5)).result(5)
    only.fails, only.offset = None, 0.5  # back, another checkpoint behind its URL
    with caplog.at_level(logging.WARNING, logger=LOGGER), pytest.raises(ServedTeacherRefusal) as raised:
        pool.ask(model, sample(1), Step.within(5)).result(5)
    problem = ("replica http://a scores the probe other than replica http://a: its log-probs are off by 0.5 nats, "
               "beyond 0.001 (another checkpoint, or the same in another precision)")
    assert raised.value.url == "http://a" and str(raised.value) == f"{problem}: {SAME}"
    warnings = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    assert f"served teacher http://a: {problem}: kept out (asked again next step); {SAME}" in warnings
    pool.close()


class Tokenizing(MemoryEndpoint):
    """A replica whose tokenizer reads any text as `ids`; `told` what each call was given."""

    def __init__(self, url: str, ids: list[int] | None) -> None:
        super().__init__(url)
        self.ids = ids
        self.told: list[tuple] = []

    def tokenize(self, model, text, deadline, cancel):
        self.told.append((model, text, deadline, cancel))
        return self.ids


def test_the_replicas_tokenize_alike_or_the_one_that_differs_is_named():
    pool = ReplicaPool([Tokenizing("http://a", [3, 4]), Tokenizing("http://b", [3, 4])], ReplicaSettings())
    model = connect(pool)
    step = Step.within(5)
    assert pool.tokenize(model, "w3 w4", step.deadline, step.cancel) == [3, 4]
    assert [replica.told for replica in pool.replicas] == [[(model, "w3 w4", step.deadline, step.cancel)]] * 2
    for other, said in (([3], "1 ids"), (None, "no tokens")):
        pool = ReplicaPool([Tokenizing("http://a", [3, 4]), Tokenizing("http://b", other)], ReplicaSettings())
        model = connect(pool)
        with pytest.raises(ServedTeacherRefusal) as raised:
            pool.tokenize(model, "w3 w4", step.deadline, step.cancel)
        assert raised.value.url == "http://a|http://b"
        assert str(raised.value) == (f"replica http://b tokenizes a probe text into other ids than replica http://a "
                                     f"({said} against 2): the replicas of one teacher serve the same tokenizer; "
                                     f"serve it the same, or take it out of the teacher's URLs")
    pool = ReplicaPool([Tokenizing("http://a", None), Tokenizing("http://b", [3])], ReplicaSettings())
    model = connect(pool)
    with pytest.raises(ServedTeacherRefusal, match=r"\(1 ids against no tokens\)"):
        pool.tokenize(model, "w3", step.deadline, step.cancel)


def test_close_does_not_wait_for_a_re_check_still_out():
    stuck = threading.Event()

    def hangs(_sample):
        stuck.wait(10)  # a replica that does not answer its re-check
        return ServedTeacherError("http://b: no answer", "http://b")

    a, b = MemoryEndpoint("http://a"), MemoryEndpoint("http://b", fails=failing("http://b"))
    pool = ReplicaPool([a, b], ReplicaSettings(hedge_after=None))
    model = connect(pool)
    b.fails = hangs
    pool.ask(model, sample(0), Step.within(5)).result(5)  # the step re-checks b in the background
    until = time.monotonic() + 5
    while b.checks < 2 and time.monotonic() < until:
        time.sleep(0.005)
    assert b.checks == 2
    start = time.monotonic()
    pool.close()
    took = time.monotonic() - start
    stuck.set()
    assert took < 2, f"close waited {took:.1f} s for the re-check"
