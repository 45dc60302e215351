"""The step's deadline bounds the whole request in wall-clock time: a server that trickles its
reply a byte a second (in its headers or its body) keeps every read under the read timeout, yet
`check()`, `score()` and `doctor` give up within the deadline + 2 s naming the URL, and in a 2-rank
world where the server trickles only rank 1's sample, both ranks raise the same ServedTeacherError through the
failure agreement (no collective timeout). A 5xx is retried with a backoff (capped at 8 s) and named
with the server's words; a slow reply names the shorter of the read timeout and the deadline."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from megatron_rl_patches.teachers import ClientSettings, ServedTeacher, ServedTeacherError, TeacherBatch
from tests.teachers.local_servers import BODY, HEADERS, completions, models, trickle, trickling, url_of, vllm_like

pytest.importorskip("httpx", reason="the served extra (httpx) is missing")

DEADLINE_S, SLACK_S = 2.0, 2.0
# a read timeout far above the deadline: only the deadline can end the request in time
SETTINGS = ClientSettings(timeout_s=60.0, deadline_s=DEADLINE_S, retries=0)


def batch() -> TeacherBatch:
    return TeacherBatch([torch.arange(6)], [3])


@pytest.mark.parametrize("head", [BODY, HEADERS], ids=["body", "headers"])
def test_check_gives_up_at_the_deadline_on_a_trickling_server(head):
    with trickling(head) as server, ServedTeacher(url_of(server), top_k=2, client=SETTINGS) as teacher:
        start = time.monotonic()
        with pytest.raises(ServedTeacherError, match=r"/v1/models: no reply within the step's deadline "
                                                     r"of 2 s") as caught:
            teacher.check()
        assert time.monotonic() - start < DEADLINE_S + SLACK_S
        assert caught.value.url == url_of(server)


def samples_trickle(body):
    """The check's two-id probe answered, a sample's scores trickled."""
    return completions(body) if len(body["prompt"]) <= 2 else trickle(body)


@pytest.mark.parametrize("named", [None, [37]], ids=["its-place", "the-callers-index"])
def test_score_gives_up_at_the_deadline_when_the_scores_trickle(named):
    """`submit(batch, samples=[37])` (a rollout asking for its sample 37 alone) names it 37, not 0."""
    with vllm_like(v1_completions=samples_trickle) as server, \
            ServedTeacher(url_of(server), top_k=2, client=SETTINGS) as teacher:
        start = time.monotonic()
        index = 0 if named is None else named[0]
        with pytest.raises(ServedTeacherError, match=rf"\(sample {index}\): no reply within") as caught:
            teacher.submit(batch(), samples=named).result()
        assert time.monotonic() - start < DEADLINE_S + SLACK_S
        assert caught.value.sample == index


@pytest.mark.parametrize("named", [[1, 2], [True], ["a"], (3,)])
def test_samples_other_than_one_int_per_sample_are_refused_by_name(named):
    with ServedTeacher("http://127.0.0.1:9", top_k=2, client=SETTINGS) as teacher:
        with pytest.raises(TypeError, match=r"ServedTeacher.submit\(samples=...\) must be a list of 1 ints"):
            teacher.submit(batch(), samples=named).result()


def test_doctor_gives_up_at_its_deadline(monkeypatch):
    from megatron_rl_patches.apps.cli import doctor
    from megatron_rl_patches.teachers.kinds import served_entry

    monkeypatch.setattr(served_entry, "DOCTOR_DEADLINE_S", DEADLINE_S)
    with trickling(BODY) as server:
        monkeypatch.setenv("MEGATRON_RL_PATCHES_OPD_TEACHERS", f"{url_of(server)};engine=vllm")
        start = time.monotonic()
        (problem,) = doctor.teacher_problems()
        assert time.monotonic() - start < DEADLINE_S + SLACK_S
    assert "no reply within the step's deadline" in problem, problem


def trickle_rank_ones(body):
    """The check's two-id probe and rank 0's sample answered, rank 1's (its first id 1) trickled."""
    return trickle(body) if len(body["prompt"]) > 2 and body["prompt"][0] == 1 else completions(body)


def trickle_on_rank_one(rank: int, world_size: int, url: str) -> str:
    """Both ranks hold the one teacher (a group's ranks must: compared before anything is asked);
    rank 1 sends a sample of its own, which the server trickles."""
    import torch.distributed as dist

    teacher = ServedTeacher(url, top_k=2, client=SETTINGS)
    start = time.monotonic()
    try:
        teacher.score(TeacherBatch([torch.arange(6) + rank], [3]), group=dist.group.WORLD)
    except ServedTeacherError as error:
        assert time.monotonic() - start < DEADLINE_S + SLACK_S
        return f"{type(error).__name__}: {error}"
    finally:
        teacher.close()
    return "no error"


def test_two_ranks_raise_the_same_error_when_only_rank_one_trickles():
    from megatron_rl_patches.testing.multirank import run_multirank

    with vllm_like(v1_completions=trickle_rank_ones) as server:
        said = run_multirank(trickle_on_rank_one, 2, url_of(server), timeout=60)
    assert said[0] == said[1], said
    assert said[0].startswith("ServedTeacherError: served teacher failed on rank 1 of the group"), said[0]
    assert "within the step's deadline" in said[0]


def _busy_then(models_after: int):
    """A /v1/models route answering 503 (the server's words: busy) `models_after` times, then the
    model list; its calls counted."""
    calls = []

    def route(body):
        calls.append(body)
        return (503, {"message": "busy"}) if len(calls) <= models_after else models(body)

    return route, calls


def test_a_5xx_is_retried_with_backoff_then_named_with_the_servers_words():
    route, calls = _busy_then(1)
    with vllm_like(v1_models=route) as server, \
            ServedTeacher(url_of(server), top_k=2, client=ClientSettings(retries=1, backoff_s=0.01)) as teacher:
        teacher.check()  # the second try answers
    assert len(calls) == 2
    for retries, tries in ((0, "1 try"), (2, "3 tries")):
        route, calls = _busy_then(99)
        settings = ClientSettings(retries=retries, backoff_s=0.01, deadline_s=20)
        with vllm_like(v1_models=route) as server, ServedTeacher(url_of(server), top_k=2, client=settings) as teacher:
            url = url_of(server)
            with pytest.raises(ServedTeacherError, match=rf"^{url}/v1/models: no answer after {tries} "
                                                         r"\(HTTP 503: busy\)$") as caught:
                teacher.check()
        assert len(calls) == retries + 1 and caught.value.url == url
    # the step's deadline ends the retries, naming the last answer
    route, calls = _busy_then(10 ** 6)
    settings = ClientSettings(retries=10 ** 6, backoff_s=0.05, deadline_s=1.0)
    with vllm_like(v1_models=route) as server, ServedTeacher(url_of(server), top_k=2, client=settings) as teacher:
        with pytest.raises(ServedTeacherError, match=r"/v1/models: no answer within the step's deadline of 1 s "
                                                     r"\(last: HTTP 503: busy\)$"):
            teacher.check()


def test_the_backoff_is_capped_at_8_s(monkeypatch):
    """25 s of backoff asked, 8 s waited between the two tries. The wait is the client's one seam,
    `cancel.wait(seconds)` (a threading.Event's): recorded here instead of slept, so the bound is the
    length asked, exactly, without 8 s of wall time (waits under 1 s, the servers' own, and any other
    thread's, such as one an earlier test of this worker process left behind, still wait)."""
    asked: list[float] = []
    event_wait = threading.Event.wait
    me = threading.get_ident()

    def recorded(self, timeout=None):
        if timeout is None or timeout < 1.0 or threading.get_ident() != me:
            return event_wait(self, timeout)
        asked.append(timeout)
        return self.is_set()

    monkeypatch.setattr(threading.Event, "wait", recorded)
    route, calls = _busy_then(99)
    settings = ClientSettings(retries=1, backoff_s=25.0, deadline_s=40)
    start = time.monotonic()
    with vllm_like(v1_models=route) as server, ServedTeacher(url_of(server), top_k=2, client=settings) as teacher:
        with pytest.raises(ServedTeacherError, match=r"no answer after 2 tries"):
            teacher.check()
    assert asked == [8.0] and len(calls) == 2
    assert time.monotonic() - start < 2 * SLACK_S  # no other wait of a second or more


def test_a_slow_reply_names_the_read_timeout_or_the_deadline_whichever_was_shorter():
    def slow(body):
        time.sleep(1.5)
        return models(body)

    for settings, bound in ((ClientSettings(timeout_s=0.3, deadline_s=20, retries=0),
                             r"ClientSettings\(timeout_s=0.3\) \(ReadTimeout\)"),
                            (ClientSettings(timeout_s=60, deadline_s=0.5, retries=0),
                             r"the step's deadline of 0.5 s")):
        with vllm_like(v1_models=slow) as server, ServedTeacher(url_of(server), top_k=2, client=settings) as teacher:
            with pytest.raises(ServedTeacherError, match=rf"/v1/models: no (complete )?reply within {bound}") as caught:
                teacher.check()
        assert caught.value.url == url_of(server)
