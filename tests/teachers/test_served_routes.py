"""A served teacher's two routes, one object each behind the one client (`teachers/served/routes.py`):
the engine's own rows (`OwnRows`: K buckets at temperature 1, no ids to score, no head) or hidden
states through a head (`HeadStates`: any K, the whole vocabulary, any temperature the head computes);
the client holds the route its `head=` chose, and a head re-cut for a host (its padding) keeps the
route, never turning a rows teacher into a head one. Nothing is asked of a server here."""
from __future__ import annotations

import pytest
import torch

from megatron_rl_patches.teachers import VOCAB, ScoringPlan, ServedTeacher, TeacherHead
from megatron_rl_patches.teachers.served.routes import HeadStates, OwnRows

URL = "http://127.0.0.1:9"  # never asked: a client connects at its first request


def head(rows: int = 12, padded: int = 12) -> TeacherHead:
    return TeacherHead(torch.randn(padded, 4, generator=torch.Generator().manual_seed(0)), rows, padded, 0)


def test_the_head_chooses_the_route_and_the_plan_is_the_teachers():
    rows = ServedTeacher(URL, top_k=3)
    assert isinstance(rows.route, OwnRows) and rows.head is None and rows.hidden_dtype is None
    assert rows.plan == ScoringPlan(3) and rows.top_k == 3 and rows.temperature == 1.0
    states = ServedTeacher(URL, head=head(), plan=ScoringPlan(5, 0.7))
    assert isinstance(states.route, HeadStates) and states.head is not None and states.temperature == 0.7
    whole = ServedTeacher(URL, head=head(), plan=ScoringPlan(VOCAB))
    assert whole.top_k is VOCAB and whole.plan.full_vocabulary


@pytest.mark.parametrize(("build", "words"), [
    (lambda: ServedTeacher(URL, plan=ScoringPlan(VOCAB)), r"an engine sends its own top-k log-probs only"),
    (lambda: ServedTeacher(URL, temperature=0.7), r"only temperature=1\.0 can be served"),
    (lambda: ServedTeacher(URL, top_k=3, plan=ScoringPlan(3)), r"not both"),
    (lambda: ServedTeacher(URL, hidden_dtype=torch.float16), r"this teacher has no head"),
])
def test_what_a_route_cannot_serve_is_refused_when_the_teacher_is_built(build, words):
    with pytest.raises(ValueError, match=words):
        build()


def test_a_head_recut_for_the_host_keeps_the_route_and_a_rows_teacher_takes_none():
    teacher = ServedTeacher(URL, head=head(), plan=ScoringPlan(4))
    padded = head(12, 16)
    teacher.head = padded
    assert teacher.head is padded and isinstance(teacher.route, HeadStates) and teacher.plan == ScoringPlan(4)
    with pytest.raises(ValueError, match="a head of width 8 for states of 4"):
        teacher.head = TeacherHead(torch.zeros(12, 8), 12, 12, 0)
    rows = ServedTeacher(URL, top_k=3)
    with pytest.raises(TypeError, match="takes no head"):
        rows.head = padded
    assert rows.head is None
