"""`TeacherStep.add(batch)` (issue 88 item 3) and `TeacherStep.metrics()` (item 4) in one process,
against a local server that answers as vLLM does: the step's samples handed over in parts as a
rollout finishes them, each part sent to the served teacher at once (the server sees it before
`collect()`), `collect()` returning every added sample's scores in the order added (the same as
one `send` of the joined batch; in-process teachers score the joined batch, privileged contexts
given per part); `send` is one `add` (a second `send` before `collect` still refused); the
step's figures per step: samples, rows, parts, the seconds `collect()` waited for the served
teacher, the served teacher's own figures (a replica killed mid-step: in the metrics and in one
warning line); `flat` gives the `teacher/...` keys a dashboard takes; answers scored before
(`ScoredBefore`) read where their digest is the teacher's batch's, the other samples asked. (The 2-rank world's add:
tests/teachers/test_teacher_step.py.)"""
from __future__ import annotations

import logging
import threading
import time

import pytest
import torch

from megatron_rl_patches.teachers import (
    ClientSettings,
    ReplicaSettings,
    ServedTeacher,
    TeacherBatch,
    TeacherStep,
    local_host,
)
from megatron_rl_patches.teachers.step.metrics import flat
from megatron_rl_patches.teachers.step.parts import ScoredBefore, ids_digest
from tests.teachers.local_servers import completions, dies_after, held, url_of, vllm_like
from tests.teachers.test_teacher_step import K, RankTeacher, batch
from tests.teachers.test_teacher_step import flat as flat_scores

pytest.importorskip("httpx", reason="the served extra (httpx) is missing")


def part(samples: TeacherBatch, *indices: int) -> TeacherBatch:
    return TeacherBatch([samples.sequences[i] for i in indices], [samples.response_starts[i] for i in indices])


class Recording(RankTeacher):
    """An in-process teacher noting every batch it scores (with `context`: a privileged one)."""

    def __init__(self, context: str | None = None) -> None:
        super().__init__(0)
        self.context, self.seen = context, []

    def score(self, samples: TeacherBatch):
        self.seen.append([s.tolist() for s in samples.sequences])
        return super().score(samples)


def test_parts_added_in_any_split_score_as_one_send_in_the_order_added():
    samples = batch()
    with vllm_like() as server, ServedTeacher(url_of(server), "vllm", top_k=K) as served:
        in_process = Recording()
        step = TeacherStep([served, in_process], local_host(12))
        step.send(samples)
        whole = [flat_scores(scores) for scores in step.collect()]
        step.add(part(samples, 0))
        step.add(part(samples, 1, 2))
        assert len(step.batch) == 3
        parted = [flat_scores(scores) for scores in step.collect()]
        step.add(part(samples, 2))
        step.add(part(samples, 0, 1))
        reordered = step.collect()
    assert parted == whole
    assert in_process.seen[1] == [s.tolist() for s in samples.sequences]  # the joined batch, one pass
    # the order added: sample 2 first
    assert [len(t) for t in reordered[0].tail_log_probs] == [samples.response_rows(i) for i in (2, 0, 1)]
    assert [len(t) for t in reordered[1].tail_log_probs] == [samples.response_rows(i) for i in (2, 0, 1)]


def test_each_part_is_sent_when_added_not_at_collect():
    release = threading.Event()
    samples = batch()
    with vllm_like(v1_completions=held(release)) as server, ServedTeacher(url_of(server), "vllm", top_k=K) as served:
        release.set()
        served.check()  # the probe answered
        release.clear()
        step = TeacherStep([served], local_host(12))
        before = server.answered("/v1/completions")
        step.add(part(samples, 0))
        deadline = time.monotonic() + 10
        while server.answered("/v1/completions") < before + 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.answered("/v1/completions") == before + 1  # asked at add, before collect
        step.add(part(samples, 1, 2))
        release.set()
        (scores,) = step.collect()
    assert len(scores) == 3 and server.answered("/v1/completions") == before + 3


def test_contexts_come_with_each_part():
    samples = batch()
    hinted = Recording(context="hint")
    step = TeacherStep([hinted], local_host(12))
    step.add(part(samples, 0), contexts={"hint": [[7, 7]]})
    step.add(part(samples, 1, 2), contexts=[{"hint": [8]}, {"hint": [9, 9, 9]}])
    (scores,) = step.collect()
    contexts = ([7, 7], [8], [9, 9, 9])
    expected = [ctx + s.tolist()[start:] for ctx, s, start in zip(contexts, samples.sequences,
                                                                   samples.response_starts)]
    assert hinted.seen == [expected] and [len(t) for t in scores.tail_log_probs] == [3, 2, 1]
    with pytest.raises(ValueError, match="no contexts were passed"):  # a part without its contexts
        step.add(part(samples, 0))


def test_send_is_one_add_and_bad_calls_are_refused():
    step = TeacherStep([RankTeacher(0)], local_host(12))
    step.send(batch())
    step.add(part(batch(), 0))  # more of the same step
    assert len(step.collect()[0]) == 4
    step.add(part(batch(), 0))
    with pytest.raises(RuntimeError, match=r"not collected: call collect\(\) once per send\(\), or add\(batch\)"):
        step.send(batch())
    step.collect()
    with pytest.raises(TypeError, match=r"^TeacherStep\.add\(batch\) takes a TeacherBatch, got list$"):
        step.add([torch.tensor([1, 2])])
    with pytest.raises(RuntimeError, match="nothing sent"):
        step.collect()


def test_metrics_count_the_steps_samples_rows_parts_and_the_wait_for_a_slow_teacher():
    slow = 0.6

    def late(body):
        time.sleep(slow)
        return completions(body)

    samples = batch()
    with vllm_like(v1_completions=late) as server, ServedTeacher(url_of(server), "vllm", top_k=K) as served:
        served.check()
        served.metrics()  # the connect's figures dropped
        step = TeacherStep([served, RankTeacher(0)], local_host(12))
        step.add(part(samples, 0))
        step.add(part(samples, 1, 2))
        step.collect()
        got = step.metrics()
        step.add(part(samples, 0))
        time.sleep(slow + 0.5)  # "the student's forward": longer than the teacher takes
        step.collect()
        hidden = step.metrics()
    assert (got["samples"], got["rows"], got["adds"], got["collects"]) == (3, 6, 2, 1)
    assert slow * 0.8 < got["collect_wait_s"] <= got["collect_s"], got
    assert got["bytes"] > 0 and got["teachers"][0]["samples"] == 3 and got["teachers"][0]["rows"] == 6
    (replica,) = got["replicas"]
    assert replica == url_of(server) and got["replicas"][replica]["latency_p50_s"] >= slow * 0.8
    assert (hidden["samples"], hidden["adds"]) == (1, 1) and hidden["collect_wait_s"] < slow / 2, hidden
    keys = flat(got)
    where = url_of(server).split("://")[1]
    assert keys["teacher/samples"] == 3 and keys["teacher/taken_out"] == 0
    assert keys[f"teacher/replica/{where}/requests"] == 3 and "teacher/teachers" not in keys
    assert all(isinstance(v, (int, float)) for v in keys.values())


def test_a_replica_killed_mid_step_shows_in_the_steps_metrics_and_one_warning(caplog):
    samples = TeacherBatch([torch.tensor([i, 1, 2, 5, 3, 4]) for i in range(8)], [3] * 8)
    settings = ClientSettings(retries=1, backoff_s=0.01, deadline_s=20.0)
    with vllm_like() as a, vllm_like(v1_completions=dies_after(2)) as b, \
            ServedTeacher([url_of(a), url_of(b)], top_k=2, client=settings,
                          replicas=ReplicaSettings(hedge_after=None)) as teacher:
        teacher.check()
        step = TeacherStep([teacher], local_host(12))
        step.metrics()
        with caplog.at_level(logging.WARNING, logger="megatron_rl_patches.teachers.served"):
            for i in range(0, 8, 2):
                step.add(part(samples, i, i + 1))
            step.collect()
        got = step.metrics()
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and url_of(b) in r.getMessage()]
    assert len(warned) == 1 and "taken out" in warned[0], warned
    assert got["taken_out"] == [url_of(b)] and got["failovers"] >= 1 and got["samples"] == 8
    assert flat(got)["teacher/taken_out"] == 1


def test_a_part_scored_before_is_not_asked_again_and_joins_the_others():
    samples = batch()
    with vllm_like() as server, ServedTeacher(url_of(server), "vllm", top_k=K) as served:
        step = TeacherStep([served, RankTeacher(0)], local_host(12))
        step.send(samples)
        whole = step.collect()
        step.metrics()
        before = server.answered("/v1/completions")
        earlier = served.score(part(samples, 0, 1))  # as a rollout asked it, sample by sample as each ended
        asked = server.answered("/v1/completions")
        step.add(part(samples, 0, 1), scored={0: earlier})
        step.add(part(samples, 2))
        joined = step.collect()
        figures = step.metrics()
    assert asked == before + 2 and server.answered("/v1/completions") == asked + 1  # only sample 2 asked by the step
    assert [flat_scores(s) for s in joined] == [flat_scores(s) for s in whole]
    assert (figures["samples"], figures["scored_before"]) == (3, 2)
    step = TeacherStep([RankTeacher(0)], local_host(12))
    with pytest.raises(ValueError, match=r"key 0 is not the index of one of the step's asynchronous \(served\)"):
        step.add(part(samples, 0), scored={0: earlier})
    with pytest.raises(ValueError, match=r"must be a BatchScores .* of the part's 1 samples, got 2 samples"):
        TeacherStep([served], local_host(12)).add(part(samples, 0), scored={0: earlier})


def test_answers_scored_before_are_read_where_their_digest_is_the_teachers_batchs_and_the_rest_asked():
    samples = batch()
    with vllm_like() as server, ServedTeacher(url_of(server), "vllm", top_k=K) as served:
        step = TeacherStep([served], local_host(12))
        step.send(samples)
        (whole,) = step.collect()
        step.metrics()
        ones = [served.score(part(samples, i)) for i in range(3)]  # as a rollout asked them, one by one
        stale = samples.sequences[1].clone()
        stale[-1] += 1  # sample 1 changed after it was scored
        given = [(ids_digest(samples.sequences[0], samples.response_starts[0]), ones[0]),
                 (ids_digest(stale, samples.response_starts[1]), ones[1]), None]
        before = server.answered("/v1/completions")
        step.add(samples, scored={0: ScoredBefore(given)})  # one part: samples 1 and 2 asked, in one run
        (got,) = step.collect()
        figures = step.metrics()
        asked = server.answered("/v1/completions") - before
        step.add(samples, scored={0: ScoredBefore([None, given[0], None])})  # a digest of another sample's ids
        (again,) = step.collect()
    assert asked == 2 and (figures["scored_before"], figures["adds"], figures["samples"]) == (1, 1, 3)
    assert flat_scores(got) == flat_scores(whole) and flat_scores(again) == flat_scores(whole)
    with pytest.raises(TypeError, match=r"teacher 0's ScoredBefore holds per sample \(digest, answer\) or None"):
        TeacherStep([served], local_host(12)).add(part(samples, 0), scored={0: ScoredBefore([ones[0]])})
    # a digest not three ints; an answer not one sample's
    wrong = [(given[0][0],), (given[0][0][0], ones[0]), (given[0][0][:2], ones[0]), ([True, 1, 2], ones[0]),
             (given[0][0], ones[0].topk_ids[0]), (given[0][0], whole)]
    for entry in wrong:
        with pytest.raises(TypeError, match=r"teacher 0's ScoredBefore holds per sample \(digest, answer\) or None: "
                                            r"the digest three ints \(ids_digest\), the answer of that one sample"):
            TeacherStep([served], local_host(12)).add(part(samples, 0), scored={0: ScoredBefore([entry])})
    with pytest.raises(ValueError, match=r"or a ScoredBefore\) of the part's 1 samples, got 3 samples"):
        TeacherStep([served], local_host(12)).add(part(samples, 0), scored={0: ScoredBefore(given)})


def test_a_digest_is_of_the_ids_and_their_response_start_not_their_dtype_or_shape():
    ids = torch.tensor([5, 7, 1 << 20])
    assert ids_digest(ids.int(), 1) == ids_digest(ids, 1) == ids_digest(ids.view(1, 3), 1)
    assert ids_digest(ids, 2) != ids_digest(ids, 1) and ids_digest(ids[:2], 1) != ids_digest(ids, 1)
    assert ids_digest(torch.tensor([5, 7, 1 << 21]), 1) != ids_digest(ids, 1)
