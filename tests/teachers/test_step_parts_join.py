"""`teachers.step.parts`' joining of a step's added parts: `joined_results` puts each part's answer
end to end (`BatchScores` field by field, per-sample lists in order; one part is itself) and
refuses parts answered alike in no way, naming what differs; `JoinedPending` asks every part for
its unprojected answer with the caller's group (one part: as asked), refuses a projected answer of
several parts (a head projects the joined batch once), and cancels every part; `Ready` is an
answer in hand; `scored_problem` names what is wrong with `add(scored=...)`, returned (the step
agrees it over its ranks), never raised. The step's own use of them: test_step_add.py and
test_teacher_step.py."""
from __future__ import annotations

import pytest
import torch

from megatron_rl_patches.teachers.contract import BatchScores
from megatron_rl_patches.teachers.step.parts import JoinedPending, Ready, joined_results, scored_problem


def scores(rows: list[int], first: float, hidden: bool = False) -> BatchScores:
    def per(width: int | None, offset: float) -> list[torch.Tensor]:
        return [torch.full((n,) if width is None else (n, width), first + offset + i, dtype=torch.float64)
                for i, n in enumerate(rows)]

    return BatchScores(per(None, 0.0), [t.long() for t in per(2, 0.1)], per(2, 0.2), per(None, 0.3),
                       hidden_states=per(4, 0.4) if hidden else None)


class Part:
    """A pending answer that records how it was asked."""

    def __init__(self, got):
        self.got, self.asked, self.cancelled = got, [], False

    def result(self, group=None, *, projected=True):
        self.asked.append((group, projected))
        return self.got

    def cancel(self):
        self.cancelled = True


def test_one_part_is_its_own_answer_and_several_are_joined_end_to_end_field_by_field():
    one = scores([2], 1.0)
    assert joined_results([one]) is one
    a, b = scores([2, 1], 1.0, hidden=True), scores([3], 5.0, hidden=True)
    joined = joined_results([a, b])
    assert len(joined) == 3 and joined.ids_log_probs is None and joined.ids_tail_log_probs is None
    for name in ("token_log_probs", "topk_ids", "topk_log_probs", "tail_log_probs", "hidden_states"):
        got, want = getattr(joined, name), getattr(a, name) + getattr(b, name)
        assert len(got) == 3 and all(x is y for x, y in zip(got, want)), name
    states = [torch.ones(2, 4), torch.zeros(1, 4)]
    assert joined_results([states[:1], (states[1],)]) == [states[0], states[1]]


def test_parts_answered_unalike_are_refused_naming_what_differs():
    with pytest.raises(TypeError, match="differ in hidden_states"):
        joined_results([scores([1], 1.0, hidden=True), scores([1], 2.0)])
    with pytest.raises(TypeError) as refused:
        joined_results([scores([1], 1.0), [torch.zeros(1, 4)]])
    assert str(refused.value) == ("TeacherStep.collect: the teacher's results of the added parts are of different "
                                  "kinds (BatchScores, list): a teacher answers every part alike")


def test_joined_pending_asks_every_part_unprojected_with_the_group_and_cancels_every_part():
    a, b = Part(scores([1], 1.0)), Part(scores([2], 2.0))
    group = object()
    joined = JoinedPending([a, b])
    with pytest.raises(ValueError) as refused:
        joined.result(group)
    assert str(refused.value) == "JoinedPending.result: ask projected=False and project the joined batch"
    assert a.asked == b.asked == []  # refused before any part was asked
    got = joined.result(group, projected=False)
    assert len(got) == 2 and got.token_log_probs[0] is a.got.token_log_probs[0]
    assert got.token_log_probs[1] is b.got.token_log_probs[0]
    assert a.asked == b.asked == [(group, False)]
    single = Part(scores([1], 3.0))
    assert JoinedPending([single]).result(group) is single.got and single.asked == [(group, True)]
    assert JoinedPending([single]).result(projected=False) is single.got and single.asked[-1] == (None, False)
    joined.cancel()
    assert a.cancelled and b.cancelled


def test_ready_is_its_answer_however_asked():
    got = scores([1], 1.0)
    ready = Ready(got)
    assert ready.result() is got and ready.result(object(), projected=False) is got
    ready.cancel()
    assert ready.result() is got


def test_what_is_wrong_with_scored_is_returned_whole_naming_the_key_or_the_answer():
    where = "TeacherStep.add(scored=...)"
    served = [True, True, False]  # two asynchronous (served) teachers, then an in-process one
    assert scored_problem(None, served, 2) is None
    assert scored_problem({0: scores([1, 1], 1.0), 1: [torch.zeros(1, 4), torch.zeros(1, 4)]}, served, 2) is None
    problem = scored_problem(5, served, 2)
    assert isinstance(problem, TypeError)
    assert str(problem) == f"{where} must map a teacher's index to its answer for the part, got int"
    for key in (True, "0", -1, 2, 3):  # a bool, not an int, out of range, the in-process teacher, past the end
        problem = scored_problem({key: scores([1, 1], 1.0)}, served, 2)
        assert isinstance(problem, ValueError), key
        assert str(problem) == (f"{where}: key {key!r} is not the index of one of the step's asynchronous (served) "
                                "teachers: an in-process teacher scores the joined batch in collect()")
    for got, shown in (("rows", "str"), (None, "NoneType"), (scores([1], 1.0), "1 samples")):
        problem = scored_problem({1: got}, served, 2)
        assert isinstance(problem, ValueError)
        assert str(problem) == (f"{where}: teacher 1's answer must be a BatchScores (or a head's states: a list; "
                                f"or a ScoredBefore) of the part's 2 samples, got {shown}")
