"""Issue 110 item 2: a `ScoringPlan`'s invariant mode is the mode its teachers' vocabulary ops run in
(before: dropped on the way down, every teacher scored in the setting's mode). The live self-teacher
(`SelfTeacher`) and a served teacher's head route (`ServedTeacher(head=...)`: its own scores through
`TeacherStep`, and its log-probs at given ids) score with `plan=ScoringPlan(K, invariant=True)` bit
for bit as MEGATRON_RL_PATCHES_INVARIANT=1 makes them, and unlike the default mode; an explicit
False wins over the setting; None (the default) is the setting's. A route that runs no trainer op
(an engine's own rows) refuses the mode; a step whose plan's mode is not its teachers' is refused."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from megatron_rl_patches.ops import lm_head
from megatron_rl_patches.teachers import (
    BatchScores,
    ScoringPlan,
    SelfTeacher,
    ServedTeacher,
    StudentHidden,
    TeacherBatch,
    TeacherHead,
    TeacherStep,
    local_host,
)
from megatron_rl_patches.teachers.step.served import HeadServed

V, H, K = 300, 16, 5
URL = "http://127.0.0.1:9"  # never asked: every sample's states are given to the step
SETTING = "MEGATRON_RL_PATCHES_INVARIANT"


def batch() -> TeacherBatch:
    gen = torch.Generator().manual_seed(11)
    return TeacherBatch([torch.randint(0, V, (n,), generator=gen) for n in (12, 9, 8)], [4, 3, 2])


def states(samples: TeacherBatch) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(12)
    return [torch.randn(samples.response_rows(i), H, generator=gen) for i in range(len(samples))]


WEIGHT = torch.randn(V, H, generator=torch.Generator().manual_seed(13)) * 0.7


def flat(scores: BatchScores) -> list[torch.Tensor]:
    return [torch.cat(getattr(scores, name)) for name in ("token_log_probs", "topk_ids", "topk_log_probs",
                                                          "tail_log_probs")]


def self_scores(plan: ScoringPlan) -> list[torch.Tensor]:
    samples = batch()
    teacher = SelfTeacher(lambda asked: StudentHidden(states(asked), WEIGHT), V, context="hint", plan=plan)
    return flat(teacher.score(samples))


def head_route_scores(plan: ScoringPlan) -> list[torch.Tensor]:
    samples = batch()
    teacher = ServedTeacher(URL, head=TeacherHead(WEIGHT, V, V, 0), plan=plan)
    step = TeacherStep([teacher], local_host(V))
    step.add(samples, scored={0: states(samples)})
    (scores,) = step.collect()
    ids = [torch.arange(i, i + 6).repeat(samples.response_rows(i), 1) for i in range(len(samples))]
    at, tails = HeadServed(teacher).at_ids(scores, ids, None)
    return [*flat(scores), torch.cat(at), torch.cat(tails)]


ROUTES: dict[str, Callable[[ScoringPlan], list[torch.Tensor]]] = {"self-teacher": self_scores,
                                                                   "served-head": head_route_scores}


def modes_chosen(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """The mode every vocabulary op of the head resolves from here on (a spy on its one switch)."""
    chosen: list[bool] = []
    real = lm_head.agreed_route

    def spied(*args: Any, **kwargs: Any) -> Any:
        mode, kernels = real(*args, **kwargs)
        chosen.append(mode)
        return mode, kernels

    monkeypatch.setattr(lm_head, "agreed_route", spied)
    return chosen


def same_bits(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("route", list(ROUTES))
def test_the_plans_invariant_mode_is_the_mode_the_scores_are_computed_in(route, monkeypatch):
    score = ROUTES[route]
    monkeypatch.delenv(SETTING, raising=False)
    chosen = modes_chosen(monkeypatch)
    default = score(ScoringPlan(K))
    assert chosen and not any(chosen)
    chosen.clear()
    planned = score(ScoringPlan(K, invariant=True))
    assert chosen and all(chosen)  # before: the default mode, the plan's True dropped
    monkeypatch.setenv(SETTING, "1")
    chosen.clear()
    by_setting = score(ScoringPlan(K))  # None: the setting's mode
    assert chosen and all(chosen)
    assert same_bits(planned, by_setting)
    assert not same_bits(planned, default)  # the two modes' bits differ on these rows
    chosen.clear()
    forced_off = score(ScoringPlan(K, invariant=False))  # an explicit False wins over the setting
    assert chosen and not any(chosen)
    assert same_bits(forced_off, default)


def test_an_engines_own_rows_refuse_the_invariant_mode_and_take_the_others():
    with pytest.raises(ValueError, match=r"an engine computes its own top-k rows, in its own mode, and the invariant "
                                         r"mode is the trainer's vocabulary ops'"):
        ServedTeacher(URL, plan=ScoringPlan(K, invariant=True))
    assert ServedTeacher(URL, plan=ScoringPlan(K, invariant=False)).invariant is False
    assert ServedTeacher(URL, top_k=K).invariant is None


def test_a_step_plan_whose_mode_its_teachers_do_not_score_in_is_refused():
    head = TeacherHead(WEIGHT, V, V, 0)
    invariant = ServedTeacher(URL, head=head, plan=ScoringPlan(K, invariant=True))
    setting = ServedTeacher(URL, head=head, plan=ScoringPlan(K))
    with pytest.raises(ValueError, match=r"scores top_k=5 at temperature 1\.0 \(invariant=None: the setting "
                                         r"MEGATRON_RL_PATCHES_INVARIANT\), the plan asks top_k=5 at 1\.0 "
                                         r"\(invariant=True\): build the teacher with the plan"):
        TeacherStep([setting], local_host(V), plan=ScoringPlan(K, invariant=True))
    with pytest.raises(ValueError, match=r"the teachers' \(top_k, temperature, invariant\) differ"):
        TeacherStep([invariant, setting], local_host(V))
    assert TeacherStep([invariant], local_host(V), plan=ScoringPlan(K, invariant=True)).plan == invariant.plan
