"""Rows handed to a teacher step instead of asked (`TeacherStep.add(batch, scored={i: ...})`, a
`ScoredBefore` whose digest matches) meet every check a served reply meets (issue 96 item 1,
`teachers/step/given_rows.py` over `teachers/served/rows_check.py`): a row that does not is refused,
naming the teacher, the sample and where the rows came from, and nothing is asked or returned;
rows as the teacher sent them are read (nothing asked). slime's carried rows:
tests/integrations/slime/test_slime_rollout_scores.py."""
from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch

from megatron_rl_patches.teachers import BatchScores, ServedTeacher, TeacherBatch, TeacherStep, local_host
from megatron_rl_patches.teachers.step.parts import ScoredBefore, ids_digest
from tests.teachers.local_servers import url_of, vllm_like
from tests.teachers.test_teacher_step import K, batch
from tests.teachers.test_teacher_step import flat as flat_scores

pytest.importorskip("httpx", reason="the served extra (httpx) is missing")

VOCAB = 12


@pytest.fixture(scope="module")
def served():
    with vllm_like() as server, ServedTeacher(url_of(server), "vllm", top_k=K) as teacher:
        teacher.check()
        yield server, teacher


def one(samples: TeacherBatch, i: int) -> TeacherBatch:
    return TeacherBatch([samples.sequences[i]], [samples.response_starts[i]])


def changed(scores: BatchScores, **fields) -> BatchScores:
    """`scores` (one sample) with some fields' tensor replaced by what `fields` makes of it."""
    return dataclasses.replace(scores, **{name: [make(getattr(scores, name)[0].clone())]
                                          for name, make in fields.items()})


def at(value: float):
    def put(values: torch.Tensor) -> torch.Tensor:
        values[0, 0] = value
        return values
    return put


def with_id(value: int):
    def put(ids: torch.Tensor) -> torch.Tensor:
        ids[0, 0] = value
        return ids
    return put


CASES = {  # (what the rows become, the words of the refusal)
    "rows-cut": (dict(token_log_probs=lambda t: t[:2], topk_ids=lambda i: i[:2], topk_log_probs=lambda v: v[:2],
                      tail_log_probs=lambda t: t[:2]), "token_log_probs is of shape (2,) and dtype torch.float64, "
                                                       "not (3,) and torch.float64"),
    "a-row-more": (dict(token_log_probs=lambda t: torch.cat([t, t[:1]]), topk_ids=lambda i: torch.cat([i, i[:1]]),
                        topk_log_probs=lambda v: torch.cat([v, v[:1]]), tail_log_probs=lambda t: torch.cat([t, t[:1]])),
                   "token_log_probs is of shape (4,)"),
    "other-k": (dict(topk_ids=lambda i: i[:, :2], topk_log_probs=lambda v: v[:, :2]),
                f"topk_ids is of shape (3, 2) and dtype torch.int64, not (3, {K}) and torch.int64"),
    "token-rows-of-another-length": (dict(token_log_probs=lambda t: t[:1]), "token_log_probs is of shape (1,)"),
    "float32-log-probs": (dict(topk_log_probs=lambda v: v.float()), "topk_log_probs is of shape (3, 4) and dtype "
                                                                    "torch.float32, not (3, 4) and torch.float64"),
    "nan": (dict(topk_log_probs=at(math.nan)),
            "topk_log_probs / token_log_probs are no log-probabilities (a NaN log-prob)"),
    "plus-inf": (dict(topk_log_probs=at(math.inf)), "topk_log_probs / token_log_probs are no "
                                                   "log-probabilities (a top-k mass or log-prob of e^inf, above 1)"),
    "plus-0.7": (dict(topk_log_probs=at(0.7)), "topk_log_probs / token_log_probs are no log-probabilities (a "
                                                  "top-k mass or log-prob of e^0.897, above 1)"),
    "nan-tail": (dict(tail_log_probs=lambda t: t.fill_(math.nan)), "tail_log_probs holds a value that is no finite"),
    "negative-id": (dict(topk_ids=with_id(-3)), "topk_ids holds a negative id (-3)"),
    "id-past-the-vocabulary": (dict(topk_ids=with_id(VOCAB)), f"topk_ids holds id {VOCAB}, past the vocabulary of "
                                                              f"{VOCAB}"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_given_row_that_a_served_reply_could_not_hold_is_refused_by_sample_and_origin(served, case):
    server, teacher = served
    samples = batch()
    good = teacher.score(one(samples, 0))
    make, words = CASES[case]
    bad = changed(good, **make)
    step = TeacherStep([teacher], local_host(VOCAB))
    before = server.answered("/v1/completions")
    given = ScoredBefore([(ids_digest(samples.sequences[0], samples.response_starts[0]), bad), None],
                         vocab_size=VOCAB)
    with pytest.raises(ValueError, match=re.escape(
            "TeacherStep.add: teacher 0's rows of sample 0 (scored= of TeacherStep.add()) are not what the served "
            f"teacher answers: {words}")):
        step.add(TeacherBatch(samples.sequences[:2], samples.response_starts[:2]), scored={0: given})
    assert server.answered("/v1/completions") == before  # refused before anything was asked
    assert step.batch is None  # nothing added: nothing to collect


def test_hidden_states_given_to_a_teacher_without_a_head_are_refused(served):
    server, teacher = served
    samples = batch()
    step = TeacherStep([teacher], local_host(VOCAB))
    states = [torch.zeros(samples.response_rows(i), 16) for i in range(3)]
    with pytest.raises(TypeError, match=re.escape(
            "TeacherStep.add: teacher 0's rows given for samples 0..2 (scored= of TeacherStep.add()) are a list: a "
            "served teacher without a head answers a BatchScores of top-k rows (hidden states only for a teacher "
            "with a head)")):
        step.add(samples, scored={0: states})
    both = teacher.score(samples)
    with_states = dataclasses.replace(both, hidden_states=states)
    with pytest.raises(ValueError, match=r"hidden_states is not None \(a teacher without a head sends none\)"):
        step.add(samples, scored={0: with_states})


def test_rows_as_the_teacher_sent_them_are_read_and_nothing_asked(served):
    server, teacher = served
    samples = batch()
    step = TeacherStep([teacher], local_host(VOCAB))
    step.send(samples)
    (whole,) = step.collect()
    given = teacher.score(samples)
    before = server.answered("/v1/completions")
    step.add(samples, scored={0: given})
    (got,) = step.collect()
    firsts = [teacher.score(one(samples, i)) for i in range(3)]
    asked = server.answered("/v1/completions")
    step.add(samples, scored={0: ScoredBefore([(ids_digest(s, start), f) for s, start, f in
                                               zip(samples.sequences, samples.response_starts, firsts)],
                                              origin="a test's rollout", vocab_size=VOCAB)})
    (again,) = step.collect()
    assert server.answered("/v1/completions") == asked == before + 3  # only the three scored by hand
    assert flat_scores(got) == flat_scores(whole) == flat_scores(again)


def test_a_scored_before_names_its_origin_and_vocabulary_by_their_kinds():
    with pytest.raises(TypeError, match=r"ScoredBefore\(origin=...\) must be words"):
        ScoredBefore([None], origin=3)
    for vocab in (0, True, 2.5):
        with pytest.raises(ValueError, match=r"ScoredBefore\(vocab_size=.*\): the teacher's vocabulary size"):
            ScoredBefore([None], vocab_size=vocab)


@pytest.mark.parametrize(("bad_id", "words"), [(-3, "holds a negative id (-3): ids are vocabulary indices"),
                                               (VOCAB, f"holds id {VOCAB}, past the student's vocabulary of {VOCAB}")])
def test_slimes_own_topk_rows_refuse_an_id_outside_the_students_vocabulary(served, bad_id, words):
    """`OwnTopkServed.rows` (what slime's step reads of a served teacher of the student's tokenizer)
    refused only ids past the vocabulary; a negative one is refused too."""
    from megatron_rl_patches.teachers.errors import ServedTeacherRefusal
    from megatron_rl_patches.teachers.step.served import OwnTopkServed

    server, teacher = served
    scores = teacher.score(batch())
    ids = [i.clone() for i in scores.topk_ids]
    ids[1][0, 0] = bad_id
    with pytest.raises(ServedTeacherRefusal, match=re.escape(f"(sample 1): the served teacher's top-k {words}")):
        OwnTopkServed(teacher, VOCAB).rows(dataclasses.replace(scores, topk_ids=ids))
    assert [i.tolist() for i in OwnTopkServed(teacher, VOCAB).rows(scores)[0]] == [i.tolist() for i in scores.topk_ids]


def test_a_head_teachers_given_states_are_checked_as_its_replies():
    """A teacher with a head answers hidden states [R, H] in its dtype, finite: scores, another
    width or dtype, or a NaN are refused (nothing is asked: the server is never reached); its own
    kind of answer is read."""
    from tests.teachers.test_teacher_step import H, head

    samples = batch()
    rows = [samples.response_rows(i) for i in range(3)]
    with ServedTeacher("http://127.0.0.1:9", head=head(), top_k=3) as teacher:
        step = TeacherStep([teacher], local_host(VOCAB))
        good = [torch.full((r, H), 0.5, dtype=teacher.hidden_dtype) for r in rows]
        nan = [s.clone() for s in good]
        nan[0][1, 0] = math.nan
        scores = BatchScores(*[[torch.zeros(r) for r in rows]] * 4)
        with pytest.raises(TypeError, match=r"are a BatchScores: a served teacher with a head answers its hidden "):
            step.add(samples, scored={0: scores})
        for given, words in (([good[0], good[1], torch.zeros(rows[2], H + 1, dtype=teacher.hidden_dtype)],
                              f"sample 2 .* the hidden states are of shape \\({rows[2]}, {H + 1}\\)"),
                             ([good[0].double(), good[1], good[2]], "sample 0 .* and dtype torch.float64"),
                             (nan, "sample 0 .* the hidden state of row 1 is not finite")):
            with pytest.raises(ValueError, match=words):
                step.add(samples, scored={0: given})
        step.add(samples, scored={0: good})
        got = step.collect(projected=False)
    assert all(torch.equal(a, b) for a, b in zip(got[0], good))
