"""`served.identity.difference` on its own, in memory (the pool's tests reach it through stand-in
servers): each difference's words whole, an answer missing on either side compared by the card
alone, probes without rows, the bounds themselves (a difference of exactly the tolerance is one
teacher), hidden states compared relative to their size (large states off by a small share are one
teacher) and all-zero states by their absolute difference."""
from __future__ import annotations

import types

import torch

from megatron_rl_patches.teachers.served.engines.protocol import ROWS, STATES, ServedModel
from megatron_rl_patches.teachers.served.identity import ROWS_NATS, STATES_RELATIVE, difference

F64 = torch.float64


def rows(token: list[float], topk: list[float]) -> types.SimpleNamespace:
    return types.SimpleNamespace(token_log_probs=torch.tensor(token, dtype=F64),
                                 topk_log_probs=torch.tensor(topk, dtype=F64))


def model(answer=None, name: str = "teacher", length: int = 64, root: str | None = None) -> ServedModel:
    return ServedModel(name, length, root=root, answer=answer)


def test_another_card_is_said_whole_with_and_without_a_root():
    said = difference(ROWS, model(root="/ckpt/a"), model(name="other", length=32))
    assert said == ("serves model 'other', max model length 32, but replica {reference} serves model 'teacher', "
                    "root '/ckpt/a', max model length 64")


def test_a_missing_answer_on_either_side_compares_the_cards_alone():
    answer = rows([-0.5], [-0.5, -1.0])
    assert difference(ROWS, model(), model(answer)) is None
    assert difference(ROWS, model(answer), model()) is None
    assert difference(STATES, model(), model(torch.ones(2, 3))) is None


def test_rows_of_other_shapes_and_probes_without_rows():
    said = difference(ROWS, model(rows([-0.5], [-0.5, -1.0])), model(rows([-0.5], [-0.5])))
    assert said == "scores the probe in other shapes than replica {reference}"
    empty = rows([], [])
    assert difference(ROWS, model(empty), model(empty)) is None  # nothing to compare: no difference


def test_rows_off_by_exactly_the_tolerance_are_one_teacher_and_beyond_are_not():
    assert difference(ROWS, model(rows([0.0], [0.0])), model(rows([-ROWS_NATS], [0.0]))) is None
    said = difference(ROWS, model(rows([0.0], [0.0])), model(rows([-0.002], [0.0])))
    assert said == ("scores the probe other than replica {reference}: its log-probs are off by 0.002 nats, beyond "
                    "0.001 (another checkpoint, or the same in another precision)")


def test_hidden_states_of_other_shapes_are_said_whole():
    said = difference(STATES, model(torch.zeros(2, 3)), model(torch.zeros(2, 4)))
    assert said == ("computes the probe's hidden states other than replica {reference}: shape (2, 4) against (2, 3)")


def test_hidden_states_are_compared_relative_to_their_size():
    large = torch.full((2, 3), 100.0, dtype=F64)
    assert difference(STATES, model(large), model(large + 0.05)) is None  # off by 5e-4 of their size
    said = difference(STATES, model(large), model(large + 0.2))
    assert said == ("computes the probe's hidden states other than replica {reference}: off by 0.002 of their mean "
                    "size, beyond 0.001 (another checkpoint, or the same in another precision)")


def test_all_zero_states_are_compared_by_their_absolute_difference_up_to_the_bound():
    zeros = torch.zeros(2, 3, dtype=F64)
    assert difference(STATES, model(zeros), model(zeros)) is None
    assert difference(STATES, model(zeros), model(zeros + STATES_RELATIVE)) is None  # exactly the tolerance
    said = difference(STATES, model(zeros), model(zeros + 0.01))
    assert said is not None and "off by 0.01 of their mean size, beyond 0.001" in said, said
