"""Issue 110 item 4: every part of a `ScoringPlan` is checked where it is made. `TopK` itself refuses
a K that is no int >= 1 (before: `TopK(0)`, `TopK(-3)` made plans, and `lm_head_topk_ids(..., TopK(-3))`
ended in torch's "negative dimension"), naming K; the temperature and the invariant mode are checked
by the plan's constructor; a checked K travels as it is."""
from __future__ import annotations

import pickle

import numpy
import pytest

from megatron_rl_patches.ops.scoring_plan import VOCAB, ScoringPlan, TopK, checked_k

BAD_K = [0, -3, True, False, 2.0, 2.5, "4", None, 2**70 * -1]


@pytest.mark.parametrize("bad", BAD_K, ids=repr)
def test_topk_refuses_what_is_no_int_of_one_or_more_naming_k(bad):
    with pytest.raises(ValueError) as refused:
        TopK(bad)
    words = str(refused.value)
    assert words.startswith("TopK(K) must be an int >= 1 (the top-k buckets per row; VOCAB for the whole vocabulary)")
    assert "got K = " in words and len(words) < 200  # a huge int shown by its size, never written out


@pytest.mark.parametrize("bad", [0, -3], ids=repr)
def test_a_plan_of_a_bad_topk_is_never_made(bad):
    with pytest.raises(ValueError, match=r"TopK\(K\) must be an int >= 1"):
        ScoringPlan(TopK(bad))
    with pytest.raises(ValueError, match=r"ScoringPlan\(top_k=\.\.\.\) must be a positive int"):
        ScoringPlan(bad)


def test_a_good_k_is_a_topk_of_its_value_kept_through_a_pickle():
    for good in (1, 7, numpy.int64(5), TopK(3)):
        made = TopK(good)
        assert type(made) is TopK and made == int(good)
        assert type(pickle.loads(pickle.dumps(made))) is TopK
    checked = TopK(4)
    assert checked_k(checked) is checked  # a TopK travels down untouched
    assert ScoringPlan(checked).k is checked


@pytest.mark.parametrize("temperature", [0, -1.0, float("nan"), float("inf"), True, "1", 1e-320, None], ids=repr)
def test_the_plans_temperature_is_checked(temperature):
    with pytest.raises(ValueError, match=r"ScoringPlan\(temperature=\.\.\.\) must be a finite number > 0"):
        ScoringPlan(3, temperature)


@pytest.mark.parametrize("mode", [1, 0, "yes", numpy.bool_(True)], ids=repr)
def test_the_plans_invariant_mode_is_true_false_or_none(mode):
    with pytest.raises(TypeError, match=r"ScoringPlan\(invariant=\.\.\.\) must be True, False or None"):
        ScoringPlan(3, invariant=mode)
    assert [ScoringPlan(VOCAB, invariant=one).invariant for one in (True, False, None)] == [True, False, None]
