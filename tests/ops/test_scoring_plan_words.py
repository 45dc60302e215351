"""`ScoringPlan` and its checks, read back whole (docs/testing.md, mutation testing): each checked
field stored as the checked value under its own name, each refusal's words whole (the argument, the
meaning, the value, cut where it is long), the bounds at their edges (K against the vocabulary, the
128-bit int shown by its size, the temperature whose reciprocal overflows), and `scoring_plan`'s two
ways of being given a plan."""
from __future__ import annotations

import dataclasses
import pickle

import numpy
import pytest

from megatron_rl_patches.ops.scoring_plan import (
    VOCAB,
    FullVocabulary,
    Planned,
    ScoringPlan,
    TopK,
    checked_k,
    checked_temperature,
    finite,
    positive_int,
    scoring_plan,
    shown,
)


def _words(kind, call, *args, **kwargs) -> str:
    with pytest.raises(kind) as refused:
        call(*args, **kwargs)
    return str(refused.value)


def test_a_number_is_finite_only_where_a_float_holds_it():
    assert [finite(v) for v in (1, 0.5, -2.0, numpy.float32(3), 10**300)] == [True] * 5
    assert [finite(v) for v in (True, False, "1", None, float("nan"), float("inf"), -float("inf"), 10**400,
                                complex(1, 0))] == [False] * 9


def test_an_int_past_128_bits_is_shown_by_its_digits():
    assert shown(2**128 - 1) == repr(2**128 - 1)  # 128 bits: written out
    assert shown(-(2**128 - 1)) == repr(-(2**128 - 1))
    assert shown(2**128) == "an int of about 39 digits"  # 129 bits; 2**128 has 39 digits
    assert shown(-(2**128)) == "an int of about 39 digits"
    assert shown(10**99) == "an int of about 100 digits"
    assert shown(numpy.int64(7)) == repr(numpy.int64(7))
    assert shown(True) == "True" and shown(2.5) == "2.5" and shown("k") == "'k'"


def test_positive_int_names_the_argument_and_its_meaning():
    assert positive_int("n", 3) == 3 and type(positive_int("n", numpy.int64(3))) is int
    assert positive_int("n", 1) == 1
    assert _words(ValueError, positive_int, "n", 0) == "n must be a positive int, got 0"
    assert _words(ValueError, positive_int, "rows", True, " (rows per step)") == (
        "rows must be a positive int (rows per step), got True")
    assert _words(ValueError, positive_int, "n", 2.0) == "n must be a positive int, got 2.0"


def test_topks_refusal_is_whole_and_cut_at_60_characters():
    assert _words(ValueError, TopK, 0) == (
        "TopK(K) must be an int >= 1 (the top-k buckets per row; VOCAB for the whole vocabulary), got K = 0")
    long = "x" * 100
    assert _words(ValueError, TopK, long).endswith("got K = " + repr(long)[:60])
    assert TopK(1) == 1 and type(TopK(numpy.int64(2))) is TopK


def test_checked_k_against_the_vocabulary():
    assert checked_k(7, vocab=8) == 7  # the tail bucket holds one id
    assert checked_k(9) == 9  # no vocabulary: no bound
    assert _words(ValueError, checked_k, 8, vocab=8) == (
        "k must be smaller than the vocabulary size 8 (global, after vocab_size) so that the tail bucket is not "
        "empty, got 8; use a smaller k")
    assert _words(ValueError, checked_k, TopK(9), "", "top_k", 8).startswith("top_k must be smaller than")
    assert _words(ValueError, checked_k, 0) == "k must be a positive int, got 0"
    assert _words(ValueError, checked_k, -1, " (buckets)", "K") == "K must be a positive int (buckets), got -1"
    assert type(checked_k(3)) is TopK


def test_checked_temperature_is_a_float_with_a_finite_reciprocal():
    assert checked_temperature(2) == 2.0 and type(checked_temperature(2)) is float
    assert checked_temperature(1e-300) == 1e-300  # 1e300: finite
    assert checked_temperature(1e-308) == 1e-308  # 1e308 still finite (twice it is not)
    assert _words(ValueError, checked_temperature, 1e-320) == (
        "temperature must be a finite number > 0 (its reciprocal finite), got 1e-320")
    assert _words(ValueError, checked_temperature, 0, "T") == (
        "T must be a finite number > 0 (its reciprocal finite), got 0")
    assert _words(ValueError, checked_temperature, -1.0).endswith("got -1.0")
    assert _words(ValueError, checked_temperature, "y" * 100).endswith("got " + repr("y" * 100)[:60])
    assert _words(ValueError, checked_temperature, 10**400).endswith("got an int of about 401 digits")


def test_a_plan_stores_each_checked_field_under_its_name():
    plan = ScoringPlan(5)
    assert type(plan.top_k) is TopK and plan.top_k == 5 and plan.k is plan.top_k
    assert type(plan.temperature) is float and plan.temperature == 1.0 and plan.invariant is None
    assert not plan.full_vocabulary
    warm = ScoringPlan(numpy.int64(3), 2, True)
    assert type(warm.top_k) is TopK and warm.top_k == 3
    assert type(warm.temperature) is float and warm.temperature == 2.0 and warm.invariant is True
    assert ScoringPlan(3, invariant=False).invariant is False
    assert [f.name for f in dataclasses.fields(plan)] == ["top_k", "temperature", "invariant"]
    assert vars(plan) == {"top_k": 5, "temperature": 1.0, "invariant": None}  # nothing else stored
    assert ScoringPlan(3) == ScoringPlan(TopK(3), 1.0, None) and hash(ScoringPlan(3)) == hash(ScoringPlan(TopK(3)))
    assert ScoringPlan(3) != ScoringPlan(3, 2.0) and ScoringPlan(3) != ScoringPlan(3, invariant=False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.top_k = 4  # type: ignore[misc]


def test_a_plan_of_the_whole_vocabulary():
    plan = ScoringPlan(VOCAB, 0.5)
    assert plan.top_k is VOCAB and plan.full_vocabulary and plan.temperature == 0.5
    assert _words(ValueError, lambda: plan.k) == (
        "this ScoringPlan scores the whole vocabulary (top_k=VOCAB): it has no top-k buckets")
    assert FullVocabulary() is VOCAB and repr(VOCAB) == "VOCAB" and pickle.loads(pickle.dumps(VOCAB)) is VOCAB


def test_a_plans_refusals_are_whole():
    assert _words(ValueError, ScoringPlan, 0) == ("ScoringPlan(top_k=...) must be a positive int (the buckets per row) "
                                                  "or VOCAB (the whole vocabulary), got 0")
    assert _words(ValueError, ScoringPlan, 3, 0) == (
        "ScoringPlan(temperature=...) must be a finite number > 0 (its reciprocal finite), got 0")
    assert _words(TypeError, ScoringPlan, 3, 1.0, 1) == (
        "ScoringPlan(invariant=...) must be True, False or None (the setting MEGATRON_RL_PATCHES_INVARIANT), got 1")
    assert _words(TypeError, ScoringPlan, 3, 1.0, "z" * 100).endswith("got " + repr("z" * 100)[:60])


class _Holder(Planned):
    def __init__(self, plan: ScoringPlan) -> None:
        self.plan = plan


def test_what_holds_a_plan_reads_its_fields_off_it():
    holder = _Holder(ScoringPlan(4, 0.7, False))
    assert holder.top_k == 4 and type(holder.top_k) is TopK and holder.temperature == 0.7 and holder.invariant is False
    assert _Holder(ScoringPlan(VOCAB)).top_k is VOCAB and _Holder(ScoringPlan(2)).invariant is None


def test_scoring_plan_from_the_short_keywords():
    assert scoring_plan(None, 4, None, "T") == ScoringPlan(4, 1.0, None)
    assert scoring_plan(None, None, 0.5, "T", 6) == ScoringPlan(6, 0.5)  # the default K where none is given
    assert scoring_plan(None, 2, None, "T", 6).top_k == 2  # a given K over the default
    assert scoring_plan(None, VOCAB, 2.0, "T").top_k is VOCAB
    assert scoring_plan(None, None, None, "T", VOCAB).full_vocabulary
    assert _words(ValueError, scoring_plan, None, 0, None, "ServedTeacher") == (
        "ServedTeacher(top_k=...) must be a positive int (the teacher's buckets per row), got 0")
    assert _words(ValueError, scoring_plan, None, None, None, "T") == (
        "T(top_k=...) must be a positive int (the teacher's buckets per row), got None")
    assert _words(ValueError, scoring_plan, None, 3, -1, "SelfTeacher") == (
        "SelfTeacher(temperature=...) must be a finite number > 0 (its reciprocal finite), got -1")


def test_scoring_plan_takes_a_plan_as_it_is_and_never_both_ways():
    plan = ScoringPlan(3, 2.0, True)
    assert scoring_plan(plan, None, None, "T") is plan
    assert scoring_plan(plan, None, None, "T", 9) is plan
    assert _words(TypeError, scoring_plan, 3, None, None, "SelfTeacher") == (
        "SelfTeacher(plan=...) must be a ScoringPlan, got int")
    both = "T: give plan=ScoringPlan(top_k, temperature) or top_k= and temperature=, not both"
    assert _words(ValueError, scoring_plan, plan, 3, None, "T") == both
    assert _words(ValueError, scoring_plan, plan, None, 1.0, "T") == both
