"""What a served teacher's answer for one sample holds, checked in one place: the client's replies
(`engines/vllm.py`'s prompt log-probs, `engines/vllm_pooling.py`'s hidden states) and the answers a
teacher step is given instead of asking (`TeacherStep.add(scored=...)`, slime's carried rows:
`teachers/step/given_rows.py`) pass the same checks.

- `log_prob_problem`: log-probabilities, not logits: none NaN, each <= 0 and a row's top-k mass
  <= 1 (within fp32 slack);
- `first_non_finite_row`: a hidden-state row holding a NaN or an infinity;
- `shape_problem`, then `values_problem`: one sample's rows as the client builds them (its
  response rows, K, tensors with data: no kernel runs), then their values (int64 ids >= 0 and
  within a vocabulary where one is known, float64 log-probs and tails), which a caller may check
  once over many samples' rows joined;
- `held_together_problem`: what a served reply holds by construction and given rows must hold
  too: each row's ids distinct (one dict's keys), the tail log(1 - sum exp(top-k)) (the client
  forms it), the actual token's log-prob its own top-k entry's where it is one of them (one entry);
- `states_problem`: one sample's hidden states as the client builds them ([rows, H] of the
  teacher's dtype, finite).

Each returns what is wrong in words (None: nothing); the caller names where the rows came from. A
tensor on the meta device (a shape without data) is named as such, never read."""
from __future__ import annotations

import math

import numpy
import torch

LOG_PROB_SLACK = 1e-3  # engines send fp32 values: a log-prob or a mass a little over 0 is rounding


def top_k_mass(values: torch.Tensor) -> torch.Tensor:
    """[R, K] log-probs -> [R] sum_k exp(l) in their dtype: a NaN among them is a NaN mass, +inf an
    infinite one; no log (each exp(l) <= the mass, so a mass within 1 bounds every log-prob)."""
    return values.exp().sum(dim=-1)


def log_prob_problem(values: torch.Tensor, token: torch.Tensor, mass: torch.Tensor | None = None) -> str | None:
    """Why `values` [R, K] (and `token` [R]) are no log-probabilities (a NaN, one above 0 or a
    row's top-k mass above 1, within `LOG_PROB_SLACK`); None where they are. `mass`: their
    `top_k_mass` where the caller has it."""
    if not values.numel():
        return None
    mass = top_k_mass(values) if mass is None else mass
    if bool(torch.isnan(mass).any()) or bool(torch.isnan(token).any()):
        return "a NaN log-prob"
    most = float(mass.max())
    worst = max(math.log(most) if most > 0 else -math.inf, float(token.max()) if token.numel() else -math.inf)
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


def no_data(name: str, value: torch.Tensor, verb: str = "is") -> str | None:
    """Words for a tensor with a shape and no data (the meta device), which no check can read."""
    if value.device.type == "meta":
        return f"{name} {verb} on the meta device (a shape without data): give the values themselves"
    return None


def tensor_problem(name: str, value: object, shape: tuple[int, ...], dtype: torch.dtype) -> str | None:
    """`value` as the client builds a field: a tensor of `shape` and `dtype`, with data."""
    if not isinstance(value, torch.Tensor):
        return f"{name} is a {type(value).__name__}, not a tensor"
    if tuple(value.shape) != shape or value.dtype != dtype:
        return f"{name} is of shape {tuple(value.shape)} and dtype {value.dtype}, not {shape} and {dtype}"
    return no_data(name, value)


def shape_problem(token: object, ids: object, values: object, tails: object, rows: int, k: int) -> str | None:
    """One sample's top-k rows as tensors a served reply holds: `token` [rows] float64, `ids`
    [rows, k] int64, `values` [rows, k] float64, `tails` [rows] float64, each with data (no kernel
    runs: what `values_problem` then reads)."""
    return tensor_problem("token_log_probs", token, (rows,), torch.float64) or \
        tensor_problem("topk_ids", ids, (rows, k), torch.int64) or \
        tensor_problem("topk_log_probs", values, (rows, k), torch.float64) or \
        tensor_problem("tail_log_probs", tails, (rows,), torch.float64)


def values_problem(token: torch.Tensor, ids: torch.Tensor, values: torch.Tensor, tails: torch.Tensor,
                   vocab_size: int | None = None, actual: torch.Tensor | None = None) -> str | None:
    """Rows of the shapes `shape_problem` checks (any number of samples' rows joined): `ids` in
    [0, vocab_size) (>= 0 where no vocabulary is known), `values` and `token` log-probabilities
    (`log_prob_problem`), `tails` finite and <= 0; with `actual` [R] (the id each row scores) also
    what a served reply holds by construction (`held_together_problem`)."""
    if ids.numel() and int(ids.min()) < 0:
        return f"topk_ids holds a negative id ({int(ids.min())})"
    if vocab_size is not None and ids.numel() and int(ids.max()) >= vocab_size:
        return f"topk_ids holds id {int(ids.max())}, past the vocabulary of {vocab_size}"
    mass = top_k_mass(values)
    bad = log_prob_problem(values, token, mass)
    if bad is not None:
        return f"topk_log_probs / token_log_probs are no log-probabilities ({bad})"
    if tails.numel() and not (bool(torch.isfinite(tails).all()) and float(tails.max()) <= LOG_PROB_SLACK):
        return "tail_log_probs holds a value that is no finite log-prob <= 0"
    return None if actual is None else held_together_problem(token, ids, values, tails, actual, mass)


def held_together_problem(token: torch.Tensor, ids: torch.Tensor, values: torch.Tensor, tails: torch.Tensor,
                          actual: torch.Tensor, mass: torch.Tensor) -> str | None:
    """What a served reply's rows hold together (its ids one dict's keys, its tail formed by the
    client), on rows whose values passed (`mass`: their `top_k_mass`; `actual` [R] the id each row
    scores): no id twice in a row; the tail's probability 1 - mass within `LOG_PROB_SLACK`; the
    token's log-prob its own top-k entry's (within `LOG_PROB_SLACK`) where the actual id is one of
    the top-k. The row named is the first wrong one."""
    if not ids.numel():
        return None
    twice = repeated_id(ids)
    if twice is not None:
        return f"topk_ids holds id {twice[1]} twice in row {twice[0]} (a served reply's ids are distinct)"
    off = (tails.exp() - (1.0 - mass)).abs() > LOG_PROB_SLACK
    if bool(off.any()):
        row = int(off.nonzero()[0])
        return (f"tail_log_probs is not log(1 - sum exp(topk_log_probs)) in row {row}: e^{float(tails[row]):.4g} = "
                f"{float(tails[row].exp()):.4g} against 1 - {float(mass[row]):.4g} = {float(1 - mass[row]):.4g}, "
                f"beyond {LOG_PROB_SLACK:g} (the client forms the tail from the top-k: teachers.tails.tail_log_probs)")
    among = ids == actual.to(ids.device)[:, None]  # at most one slot a row: the ids are distinct
    own = values.masked_fill(~among, 0.0).sum(dim=-1)
    wrong = among.any(dim=-1) & ((own - token).abs() > LOG_PROB_SLACK)
    if bool(wrong.any()):
        row = int(wrong.nonzero()[0])
        return (f"token_log_probs differs from its own top-k entry in row {row}: id {int(actual[row])} scores "
                f"{float(token[row]):.6g} as the token and {float(own[row]):.6g} in the top-k (a served reply holds "
                f"one entry per id)")
    return None


def repeated_id(ids: torch.Tensor) -> tuple[int, int] | None:
    """(row, id) of the first row of `ids` [R, K] holding an id twice, or None. Sorted per row by
    numpy on the CPU (torch's sort of many short rows is ~6x slower there)."""
    ordered = numpy.sort(ids.numpy(), axis=1) if ids.device.type == "cpu" else ids.sort(dim=-1).values.cpu().numpy()
    same = ordered[:, 1:] == ordered[:, :-1]
    rows = same.any(axis=1)
    if not rows.any():
        return None
    row = int(rows.argmax())
    return row, int(ordered[row, 1:][same[row]][0])


def states_problem(states: object, rows: int, width: int, dtype: torch.dtype | None) -> str | None:
    """One sample's hidden states as a served reply holds them: a [rows, width] tensor of `dtype`
    (any floating dtype where None), every row finite."""
    if not isinstance(states, torch.Tensor):
        return f"the hidden states are a {type(states).__name__}, not a tensor"
    if tuple(states.shape) != (rows, width) or (dtype is not None and states.dtype != dtype) \
            or not states.dtype.is_floating_point:
        return (f"the hidden states are of shape {tuple(states.shape)} and dtype {states.dtype}, not "
                f"{(rows, width)} and {dtype if dtype is not None else 'a floating dtype'}")
    empty = no_data("the hidden states", states, "are")
    if empty is not None:
        return empty
    row = first_non_finite_row(states)
    return None if row is None else f"the hidden state of row {row} is not finite"
