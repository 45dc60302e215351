"""What a served teacher's answer for one sample holds, checked in one place: the client's replies
(`engines/vllm.py`'s prompt log-probs, `engines/vllm_pooling.py`'s hidden states) and the answers a
teacher step is given instead of asking (`TeacherStep.add(scored=...)`, slime's carried rows:
`teachers/step/given_rows.py`) pass the same checks.

- `log_prob_problem`: log-probabilities, not logits: none NaN, each <= 0 and a row's top-k mass
  <= 1 (within fp32 slack);
- `first_non_finite_row`: a hidden-state row holding a NaN or an infinity;
- `scores_problem`: one sample's rows as the client builds them (its response rows, K, int64 ids
  >= 0 and within a vocabulary where one is known, float64 log-probs and tails);
- `states_problem`: one sample's hidden states as the client builds them ([rows, H] of the
  teacher's dtype, finite).

Each returns what is wrong in words (None: nothing); the caller names where the rows came from."""
from __future__ import annotations

import math

import torch

LOG_PROB_SLACK = 1e-3  # engines send fp32 values: a log-prob or a mass a little over 0 is rounding


def log_prob_problem(values: torch.Tensor, token: torch.Tensor) -> str | None:
    """Why `values` [R, K] (and `token` [R]) are no log-probabilities (a NaN, one above 0 or a
    row's top-k mass above 1, within `LOG_PROB_SLACK`); None where they are."""
    if not values.numel():
        return None
    if bool(torch.isnan(values).any()) or bool(torch.isnan(token).any()):
        return "a NaN log-prob"
    mass = torch.logsumexp(values, dim=-1)
    worst = max(float(mass.max()), float(values.max()), float(token.max()) if token.numel() else -math.inf)
    if worst > LOG_PROB_SLACK:
        return f"a top-k mass or log-prob of e^{worst:.3g}, above 1"
    return None


def first_non_finite_row(states: torch.Tensor) -> int | None:
    """The first row of `states` [R, H] holding a NaN or an infinity (None: every row finite).
    One sum first (a NaN or an infinity makes it non-finite; finite values may overflow it, so
    only a non-finite sum pays for the row-by-row check); fp8 (no sum on the CPU) through float16,
    which holds every fp8 value exactly."""
    checked = states.to(torch.float16) if states.element_size() == 1 else states
    if not checked.numel() or bool(torch.isfinite(checked.sum())):
        return None
    bad = (~torch.isfinite(checked)).any(dim=1).nonzero()
    return int(bad[0]) if bad.numel() else None


def tensor_problem(name: str, value: object, shape: tuple[int, ...], dtype: torch.dtype) -> str | None:
    """`value` as the client builds a field: a tensor of `shape` and `dtype`."""
    if not isinstance(value, torch.Tensor):
        return f"{name} is a {type(value).__name__}, not a tensor"
    if tuple(value.shape) != shape or value.dtype != dtype:
        return f"{name} is of shape {tuple(value.shape)} and dtype {value.dtype}, not {shape} and {dtype}"
    return None


def scores_problem(token: object, ids: object, values: object, tails: object, rows: int, k: int,
                   vocab_size: int | None = None) -> str | None:
    """One sample's top-k rows as a served reply holds them: `token` [rows] float64, `ids`
    [rows, k] int64 in [0, vocab_size) (>= 0 where no vocabulary is known), `values` [rows, k]
    float64 log-probabilities (`log_prob_problem`), `tails` [rows] float64 finite and <= 0."""
    wrong = tensor_problem("token_log_probs", token, (rows,), torch.float64) or \
        tensor_problem("topk_ids", ids, (rows, k), torch.int64) or \
        tensor_problem("topk_log_probs", values, (rows, k), torch.float64) or \
        tensor_problem("tail_log_probs", tails, (rows,), torch.float64)
    if wrong is not None:
        return wrong
    assert isinstance(ids, torch.Tensor) and isinstance(values, torch.Tensor)
    assert isinstance(token, torch.Tensor) and isinstance(tails, torch.Tensor)
    if ids.numel() and int(ids.min()) < 0:
        return f"topk_ids holds a negative id ({int(ids.min())})"
    if vocab_size is not None and ids.numel() and int(ids.max()) >= vocab_size:
        return f"topk_ids holds id {int(ids.max())}, past the vocabulary of {vocab_size}"
    bad = log_prob_problem(values, token)
    if bad is not None:
        return f"topk_log_probs / token_log_probs are no log-probabilities ({bad})"
    if tails.numel() and not (bool(torch.isfinite(tails).all()) and float(tails.max()) <= LOG_PROB_SLACK):
        return "tail_log_probs holds a value that is no finite log-prob <= 0"
    return None


def states_problem(states: object, rows: int, width: int, dtype: torch.dtype | None) -> str | None:
    """One sample's hidden states as a served reply holds them: a [rows, width] tensor of `dtype`
    (any floating dtype where None), every row finite."""
    if not isinstance(states, torch.Tensor):
        return f"the hidden states are a {type(states).__name__}, not a tensor"
    if tuple(states.shape) != (rows, width) or (dtype is not None and states.dtype != dtype) \
            or not states.dtype.is_floating_point:
        return (f"the hidden states are of shape {tuple(states.shape)} and dtype {states.dtype}, not "
                f"{(rows, width)} and {dtype if dtype is not None else 'a floating dtype'}")
    row = first_non_finite_row(states)
    return None if row is None else f"the hidden state of row {row} is not finite"
