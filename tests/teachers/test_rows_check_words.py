"""`served.rows_check` in memory (issue 105 item 10, the mutation run): each value rule at its edge
(a log-prob or a token's entry exactly the tolerance away, a top-k of no mass, an infinitely unlikely
token's own entry, a logit past exp's range), no numpy warning on any of them, and the words for a
field or states that are no tensor said whole."""
from __future__ import annotations

import math
import warnings

import pytest
import torch

from megatron_rl_patches.teachers.served.rows_check import (
    LOG_PROB_SLACK,
    states_problem,
    tensor_problem,
    values_problem,
)

INF = math.inf


def check(values, token, tails, actual, ids=None):
    """`values_problem` of one-row-or-more rows given as lists, numpy's warnings raised as errors."""
    values = torch.tensor(values, dtype=torch.float64)
    ids = torch.arange(values.shape[1]).expand(values.shape).clone() if ids is None else torch.tensor(ids)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return values_problem(torch.tensor(token, dtype=torch.float64), ids, values,
                              torch.tensor(tails, dtype=torch.float64), None, torch.tensor(actual))


def test_a_token_entry_exactly_the_tolerance_away_is_read_and_past_it_refused():
    # id 0 at log-prob 0 (mass 1); the token is id 0, scored 0.001 (the tolerance) or more below its entry
    tail = [math.log(torch.finfo(torch.float32).eps)]
    assert check([[0.0, -INF, -INF]], [-LOG_PROB_SLACK], tail, [0]) is None
    assert check([[0.0, -INF, -INF]], [-2 * LOG_PROB_SLACK], tail, [0]) == (
        "token_log_probs differs from its own top-k entry in row 0: id 0 scores -0.002 as the token and 0 in the "
        "top-k (a served reply holds one entry per id)")


def test_a_token_log_prob_of_exactly_the_tolerance_is_read():
    # a top-k of no mass, the tail the whole (rounded a little over 1): the token (id 5, none of the
    # top-k) may take it all, up to the tolerance
    tail = [LOG_PROB_SLACK / 2]
    assert check([[-INF, -INF]], [LOG_PROB_SLACK], tail, [5], ids=[[0, 1]]) is None
    assert check([[-INF, -INF]], [2 * LOG_PROB_SLACK], tail, [5], ids=[[0, 1]]) == (
        "topk_log_probs / token_log_probs are no log-probabilities (a top-k mass or log-prob of e^0.002, above 1)")


def test_a_top_k_of_no_mass_and_an_infinitely_unlikely_token_are_read_without_a_warning():
    # every top-k value -inf (mass 0: no log of it), the tail the whole mass; the token (id 0) -inf, its entry -inf
    assert check([[-INF, -INF]], [-INF], [0.0], [0]) is None


def test_a_logit_past_exps_range_is_refused_without_a_warning():
    assert check([[800.0, -1.0]], [-1.0], [-1.0], [7], ids=[[0, 1]]) == (
        "topk_log_probs / token_log_probs are no log-probabilities (a top-k mass or log-prob of e^inf, above 1)")


def test_a_tail_of_minus_infinity_is_refused():
    half = math.log(0.5)
    assert check([[half, half]], [half], [-INF], [0]) == "tail_log_probs holds a value that is no finite log-prob <= 0"


def test_a_field_or_states_that_are_no_tensor_are_named_whole():
    assert tensor_problem("topk_ids", [[1, 2]], (1, 2), torch.int64) == "topk_ids is a list, not a tensor"
    assert states_problem([0.5], 1, 4, None) == "the hidden states are a list, not a tensor"
    assert states_problem(torch.zeros(2, 4, dtype=torch.int64), 2, 4, None) == (
        "the hidden states are of shape (2, 4) and dtype torch.int64, not (2, 4) and a floating dtype")
    assert states_problem(torch.zeros(2, 3), 2, 4, torch.bfloat16) == (
        "the hidden states are of shape (2, 3) and dtype torch.float32, not (2, 4) and torch.bfloat16")
    assert states_problem(torch.zeros(2, 4), 2, 4, None) is None


@pytest.mark.parametrize("tails", [[math.nan], [INF]])
def test_a_tail_that_is_no_finite_log_prob_is_refused(tails):
    assert check([[math.log(0.5), math.log(0.25)]], [math.log(0.5)], tails, [0]) == \
        "tail_log_probs holds a value that is no finite log-prob <= 0"
