"""A job starts while a replica is down (issue 86 item 4): the replicas that answer and agree
(at least `ReplicaSettings(min_replicas=...)`, default 1) start the teacher, the others are named
in one warning (redacted) and asked again between steps (re-probed before they get a sample);
fewer than `min_replicas` answering is one error naming each. Stand-in servers and in-memory
endpoints."""
from __future__ import annotations

import logging
import time

import pytest
import torch

from megatron_rl_patches.teachers import (
    ClientSettings,
    ReplicaSettings,
    ServedTeacher,
    ServedTeacherError,
    TeacherBatch,
)
from megatron_rl_patches.teachers.served.endpoint import SampleAsk, Step
from megatron_rl_patches.teachers.served.pool import ReplicaPool
from tests.teachers.local_servers import url_of, vllm_like
from tests.teachers.served.memory_endpoints import MemoryEndpoint, failing

pytest.importorskip("httpx", reason="the served extra (httpx) is missing")

FAST = ClientSettings(retries=1, backoff_s=0.01, deadline_s=20.0, timeout_s=20.0)
COMPLETIONS = "/v1/completions"
LOGGER = "megatron_rl_patches.teachers.served"


def batch(samples: int = 4) -> TeacherBatch:
    return TeacherBatch([torch.tensor([i, 1, 2, 5, 3, 4]) for i in range(samples)], [3] * samples)


def warnings_of(caplog) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]


def test_a_teacher_starts_with_the_replicas_that_answer_and_asks_the_others_again(caplog):
    with vllm_like() as a, vllm_like() as b, vllm_like() as c:
        b.dead = c.dead = True  # down at start: every connection cut
        with ServedTeacher([url_of(a), url_of(b), url_of(c)], top_k=2, client=FAST) as teacher:
            with caplog.at_level(logging.WARNING, logger=LOGGER):
                teacher.check()
                scores = teacher.score(batch())
            (warning,) = warnings_of(caplog)
            assert url_of(b) in warning and url_of(c) in warning and "2 of the teacher's 3 replicas" in warning
            assert len(scores) == 4
            b.dead = False  # back up: re-checked at the next step, in the background, then sent samples
            sent: list = []
            for _ in range(200):
                teacher.score(batch())
                sent = [body for path, body in b.bodies if path == COMPLETIONS and len(body["prompt"]) == 6]
                if sent:
                    break
    assert sent, "the replica that came back got no sample"


def test_fewer_than_min_replicas_answering_is_one_error_naming_each():
    with vllm_like() as a, vllm_like() as b:
        b.dead = True
        with ServedTeacher([url_of(a), url_of(b)], top_k=2, client=FAST,
                           replicas=ReplicaSettings(min_replicas=2)) as teacher:
            with pytest.raises(ServedTeacherError, match=rf"1 of the teacher's 2 replicas answered at connect, fewer "
                                                         rf"than ReplicaSettings\(min_replicas=2\): {url_of(b)}"):
                teacher.check()


def test_min_replicas_is_checked():
    for bad in (0, -1, 1.5, True, 10 ** 30):
        with pytest.raises((TypeError, ValueError), match="min_replicas"):
            ReplicaSettings(min_replicas=bad)
    with pytest.raises(ValueError, match="min_replicas=3.*names 2 replicas"):
        ServedTeacher("http://a:1|http://b:2", replicas=ReplicaSettings(min_replicas=3))


def test_in_memory_the_replica_down_at_start_is_re_probed_before_use(caplog):
    a, b = MemoryEndpoint("http://a"), MemoryEndpoint("http://b", fails=failing("http://b"))
    pool = ReplicaPool([a, b], ReplicaSettings(hedge_after=None))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        pool.served_model(Step.within(5).deadline, Step.within(5).cancel)
    assert len(warnings_of(caplog)) == 1 and "http://b" in warnings_of(caplog)[0]
    step = Step.within(5)
    assert pool.ask(a.model, *_one(0, step)).result(5) is not None and b.asked == []
    b.fails = None  # back: re-checked at the next step (in the background), then sent samples
    for i in range(1, 200):
        pool.ask(a.model, *_one(i, Step.within(5))).result(5)
        if b.asked:
            break
        time.sleep(0.005)
    assert b.checks >= 2 and b.asked, (b.checks, b.asked)


def _one(index: int, step: Step):
    return SampleAsk([index, 1, 2, 5, 3, 4], 3, index), step
