"""What every score of a step is computed with, made once and passed down (`ScoringPlan`): the
top-k size K (a `TopK`) or the whole vocabulary (`VOCAB`), the temperature and the invariant mode
(None: the setting's), each checked in its constructor, once. A framework's door builds it from its
settings (slime's from MEGATRON_RL_PATCHES_OPD_K, verl's and NeMo-RL's from their loss configs), a
hand-written loop from its arguments; teachers take it (`ServedTeacher(plan=...)`,
`SelfTeacher(plan=...)`, `build_teachers`, `TeacherStep`), and the ops take its K as it is and its
mode as their `invariant=`.

K is checked here only (`checked_k`, which every public op calls on a plain `k` and which a `TopK`
passes untouched; against a vocabulary, K < V so that the tail bucket is not empty), and so is a
positive whole-number argument (`positive_int`). Standard library only: the settings' parsers and
the torch-free sizing formulas import it."""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any

LOG10_2 = math.log10(2)


def finite(value: object) -> bool:
    """Whether `value` is a real number (no bool) that a float holds, finite."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int past a float's range
        return False


def shown(value: object) -> str:
    """`repr(value)`, an int past int64 too large to write out shown by its size."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and abs(int(value)).bit_length() > 128:
        return f"an int of about {int(abs(int(value)).bit_length() * LOG10_2) + 1} digits"
    return repr(value)


def positive_int(name: str, value: Any, meaning: str = "") -> int:
    """`value` as an int when it is an integer >= 1 (bool excluded, numpy integers accepted);
    ValueError naming `name` (and what it means) otherwise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be a positive int{meaning}, got {value!r}")
    return int(value)


class TopK(int):
    """A top-k size checked (a positive int, checked here whoever makes it: :func:`checked_k`, a
    plan's, a parsed setting's, a processor's, or a caller's own `TopK(K)`); the ops take it as it is."""

    __slots__ = ()

    def __new__(cls, k: Any) -> TopK:
        if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 1:
            raise ValueError(f"TopK(K) must be an int >= 1 (the top-k buckets per row; VOCAB for the whole "
                             f"vocabulary), got K = {shown(k)[:60]}")
        return super().__new__(cls, int(k))


class FullVocabulary:
    """K = the whole vocabulary: no top-k buckets, the divergence over every id from the hidden
    states (`VOCAB`, the one instance; slime's MEGATRON_RL_PATCHES_OPD_K=vocab)."""

    _one: FullVocabulary | None = None

    def __new__(cls) -> FullVocabulary:
        if cls._one is None:
            cls._one = super().__new__(cls)
        return cls._one

    def __repr__(self) -> str:
        return "VOCAB"

    def __reduce__(self) -> str:
        return "VOCAB"  # unpickled as this module's one instance


VOCAB = FullVocabulary()


def checked_k(k: Any, meaning: str = "", name: str = "k", vocab: int | None = None) -> TopK:
    """`k` checked once: a :class:`TopK` as it is, anything else a positive int (ValueError naming
    `name`, and what it means); with `vocab` (the global vocabulary an op scores over) also smaller
    than it, so that the tail bucket is not empty."""
    checked = k if isinstance(k, TopK) else TopK(positive_int(name, k, meaning))
    if vocab is not None and checked >= vocab:
        raise ValueError(f"{name} must be smaller than the vocabulary size {vocab} (global, after vocab_size) so "
                         f"that the tail bucket is not empty, got {int(checked)}; use a smaller k")
    return checked


def checked_temperature(temperature: Any, name: str = "temperature") -> float:
    """`temperature` as a float when it is a finite number > 0 whose reciprocal is finite too (the
    ops divide by it; bool excluded); ValueError naming `name` otherwise."""
    if not finite(temperature) or not temperature > 0 or not math.isfinite(1.0 / float(temperature)):
        raise ValueError(f"{name} must be a finite number > 0 (its reciprocal finite), got {shown(temperature)[:60]}")
    return float(temperature)


@dataclass(frozen=True)
class ScoringPlan:
    """What every score of a step is computed with: `top_k` the buckets per row (a `TopK`) or
    `VOCAB` (the whole vocabulary), `temperature` the softmax temperature (finite, > 0), `invariant`
    the invariant mode (docs/train-rollout-agreement.md), handed to every vocabulary op as its
    `invariant=`: True or False that mode whatever the setting says, None (the default) the
    setting's (MEGATRON_RL_PATCHES_INVARIANT), as an op's own None. Checked here, once; compared
    whole (two plans are the same plan when their three fields are equal)."""

    top_k: Any
    temperature: float = 1.0
    invariant: bool | None = None

    def __post_init__(self) -> None:
        if self.top_k is not VOCAB:
            object.__setattr__(self, "top_k", checked_k(self.top_k, " (the buckets per row) or VOCAB (the whole "
                                                        "vocabulary)", "ScoringPlan(top_k=...)"))
        object.__setattr__(self, "temperature", checked_temperature(self.temperature,
                                                                    "ScoringPlan(temperature=...)"))
        if self.invariant is not None and not isinstance(self.invariant, bool):
            raise TypeError(f"ScoringPlan(invariant=...) must be True, False or None (the setting "
                            f"MEGATRON_RL_PATCHES_INVARIANT), got {shown(self.invariant)[:60]}")

    @property
    def full_vocabulary(self) -> bool:
        """Whether the plan scores the whole vocabulary (no top-k buckets)."""
        return self.top_k is VOCAB

    @property
    def k(self) -> TopK:
        """The plan's K; ValueError for a plan of the whole vocabulary (it has no buckets)."""
        if self.top_k is VOCAB:
            raise ValueError("this ScoringPlan scores the whole vocabulary (top_k=VOCAB): it has no top-k buckets")
        return self.top_k


class Planned:
    """What holds a `ScoringPlan` (`plan`: a teacher, a build's options) reads its K, temperature
    and mode off it: `top_k` (the plan's K), `temperature` and `invariant`."""

    plan: ScoringPlan

    @property
    def top_k(self) -> TopK | FullVocabulary:
        """Its own top-k buckets per row: the plan's K (`VOCAB`: the whole vocabulary, no buckets)."""
        return self.plan.top_k

    @property
    def temperature(self) -> float:
        """The temperature it scores at: the plan's."""
        return self.plan.temperature

    @property
    def invariant(self) -> bool | None:
        """The mode its vocabulary ops run in: the plan's (None: the setting's)."""
        return self.plan.invariant


def scoring_plan(plan: Any, top_k: Any, temperature: Any, who: str, top_k_default: Any = None) -> ScoringPlan:
    """The plan a teacher or a build takes: `plan` (a `ScoringPlan`) or, written the short way,
    `top_k` and `temperature` made into one (the documented keywords of `ServedTeacher`,
    `SelfTeacher`, `build_teachers`); both ways at once refused naming `who`."""
    if plan is None:  # each value checked under the caller's name, then taken by the plan as it is
        k = top_k_default if top_k is None else top_k
        k = k if k is VOCAB else checked_k(k, " (the teacher's buckets per row)", f"{who}(top_k=...)")
        return ScoringPlan(k, checked_temperature(1.0 if temperature is None else temperature,
                                                  f"{who}(temperature=...)"))
    if not isinstance(plan, ScoringPlan):
        raise TypeError(f"{who}(plan=...) must be a ScoringPlan, got {type(plan).__name__}")
    if top_k is not None or temperature is not None:
        raise ValueError(f"{who}: give plan=ScoringPlan(top_k, temperature) or top_k= and temperature=, not both")
    return plan
