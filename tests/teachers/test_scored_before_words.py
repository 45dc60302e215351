"""`ScoredBefore` and its readers in memory (`teachers/step/parts.py`): its argument refusals said
whole, `before_runs`' runs of usable and to-be-asked samples, `one_sample_before`'s shape check."""
from __future__ import annotations

import pytest
import torch

from megatron_rl_patches.teachers import TeacherBatch
from megatron_rl_patches.teachers.contract import BatchScores
from megatron_rl_patches.teachers.step.parts import (
    ScoredBefore,
    answer_runs,
    before_runs,
    ids_digest,
    one_sample_before,
)


def one(value: float) -> BatchScores:
    return BatchScores([torch.tensor([value])], [torch.tensor([[0]])], [torch.tensor([[value]])],
                       [torch.tensor([-5.0])])


def test_its_arguments_are_refused_whole():
    with pytest.raises(TypeError) as caught:
        ScoredBefore([], origin=3)  # type: ignore[arg-type]
    assert str(caught.value) == "ScoredBefore(origin=...) must be words naming where the rows came from, got int"
    for vocab in (0, -1, True, 2.0):
        with pytest.raises(ValueError) as refused:
            ScoredBefore([], vocab_size=vocab)  # type: ignore[arg-type]
        assert str(refused.value) == f"ScoredBefore(vocab_size={vocab!r}): the teacher's vocabulary size (a positive " \
            "int) or None"
    assert ScoredBefore([None, None], vocab_size=1).vocab_size == 1 and len(ScoredBefore([None, None])) == 2
    assert ScoredBefore([]).origin == "scored= of TeacherStep.add()" and ScoredBefore([]).vocab_size is None


def test_before_runs_reads_the_samples_whose_digest_is_the_batchs_and_asks_the_others():
    seqs = [torch.tensor([1, 2, 3]), torch.tensor([4, 5]), torch.tensor([6, 7, 8]), torch.tensor([9, 1])]
    batch = TeacherBatch(seqs, [1, 1, 2, 1])
    given = [(ids_digest(seqs[0], 1), one(-0.5)), (ids_digest(seqs[1], 1), one(-0.25)),
             (ids_digest(seqs[2], 1), one(-1.0)),  # another response start: stale
             None]
    runs = before_runs(ScoredBefore(given), batch)
    assert [(lo, hi, answer is None) for lo, hi, answer in runs] == [(0, 2, False), (2, 4, True)]
    joined = runs[0][2]
    assert [float(t) for t in joined.token_log_probs] == [-0.5, -0.25]
    assert answer_runs(ScoredBefore(given), batch) == runs
    whole = one(-0.5)
    assert answer_runs(whole, batch) == [(0, 4, whole)]
    last = before_runs(ScoredBefore([None, None, None, (ids_digest(seqs[3], 1), one(-2.0))]), batch)
    assert [(lo, hi) for lo, hi, _ in last] == [(0, 3), (3, 4)] and last[0][2] is None and \
        [float(t) for t in last[1][2].token_log_probs] == [-2.0]


@pytest.mark.parametrize(("given", "is_one"), [
    (([1, 2, 3], one(0.0)), True),
    (((1, 2, 3), [torch.zeros(1, 2)]), True),
    ([[1, 2, 3], one(0.0)], False),
    (([1, 2, 3], one(0.0), None), False),
    (([1, 2], one(0.0)), False),
    (("abc", one(0.0)), False),
    (([1, True, 3], one(0.0)), False),
    (([1, 2.0, 3], one(0.0)), False),
    (([1, 2, 3], "a"), False),
    (([1, 2, 3], [torch.zeros(1, 2), torch.zeros(1, 2)]), False),
])
def test_one_sample_before_takes_three_ints_and_one_samples_answer(given, is_one):
    assert one_sample_before(given) is is_one
