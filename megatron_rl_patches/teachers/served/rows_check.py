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
- `held_together_problem` (inside `values_problem`): what a served reply holds by construction
  and given rows must hold too: each row's ids distinct (one dict's keys), the tail log(1 - sum exp(top-k)) (the client
  forms it), the actual token's log-prob its own top-k entry's where it is one of them (one entry),
  and no more probable than the tail where it is none of them (the tail's mass holds it);
- `states_problem`: one sample's hidden states as the client builds them ([rows, H] of the
  teacher's dtype, finite).

Each returns what is wrong in words (None: nothing); the caller names where the rows came from. A
tensor on the meta device (a shape without data) is named as such, never read."""
from __future__ import annotations

import math

import numpy
import torch

LOG_PROB_SLACK = 1e-3  # engines send fp32 values: a log-prob or a mass a little over 0 is rounding


def values_of(tensor: torch.Tensor) -> numpy.ndarray:
    """`tensor`'s values as numpy reads them: a view of a CPU tensor (a copy from another device).
    The value checks run in numpy: a few large passes, each cheaper than torch's call overhead
    on a sample's small rows, and numpy's per-row sort of short rows ~6x torch's."""
    return tensor.detach().cpu().numpy()


def top_k_mass(values: numpy.ndarray) -> numpy.ndarray:
    """[R, K] log-probs -> [R] sum_k exp(l): a NaN among them is a NaN mass, +inf an infinite one;
    no log (each exp(l) <= the mass, so a mass within 1 bounds every log-prob)."""
    with numpy.errstate(over="ignore"):  # a logit past 709 is an infinite mass, refused by its caller
        return numpy.exp(values).sum(axis=-1)


def log_prob_problem(values: torch.Tensor, token: torch.Tensor) -> str | None:
    """Why `values` [R, K] (and `token` [R]) are no log-probabilities (a NaN, one above 0 or a
    row's top-k mass above 1, within `LOG_PROB_SLACK`); None where they are."""
    if not values.numel():
        return None
    return mass_problem(top_k_mass(values_of(values)), values_of(token))


def mass_problem(mass: numpy.ndarray, token: numpy.ndarray) -> str | None:
    """`log_prob_problem` given the rows' `top_k_mass` (one row at least)."""
    if numpy.isnan(mass).any() or numpy.isnan(token).any():
        return "a NaN log-prob"
    most = float(mass.max())
    worst = max(math.log(most) if most > 0 else -math.inf, float(token.max()))  # a mass of 0: every value -inf
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
                   vocab_size: int | None, actual: torch.Tensor) -> str | None:
    """Rows of the shapes `shape_problem` checks (any number of samples' rows joined; `actual` [R]
    the id each row scores): `ids` in [0, vocab_size) (>= 0 where no vocabulary is known), `values`
    and `token` log-probabilities (`log_prob_problem`), `tails` finite and <= 0, and what a served
    reply holds by construction (`held_together_problem`)."""
    if not ids.numel():
        return None
    top, order = values_of(ids), numpy.sort(values_of(ids), axis=1)  # each row's ids in order: their range, repeats
    if int(order[:, 0].min()) < 0:
        return f"topk_ids holds a negative id ({int(order[:, 0].min())})"
    if vocab_size is not None and int(order[:, -1].max()) >= vocab_size:
        return f"topk_ids holds id {int(order[:, -1].max())}, past the vocabulary of {vocab_size}"
    logp, own, tail = values_of(values), values_of(token), values_of(tails)
    mass = top_k_mass(logp)
    bad = mass_problem(mass, own)
    if bad is not None:
        return f"topk_log_probs / token_log_probs are no log-probabilities ({bad})"
    if tail.size and not (numpy.isfinite(tail).all() and float(tail.max()) <= LOG_PROB_SLACK):
        return "tail_log_probs holds a value that is no finite log-prob <= 0"
    return held_together_problem(own, top, order, logp, tail, values_of(actual), mass)


def held_together_problem(token: numpy.ndarray, ids: numpy.ndarray, ordered: numpy.ndarray, values: numpy.ndarray,
                          tails: numpy.ndarray, actual: numpy.ndarray, mass: numpy.ndarray) -> str | None:
    """What a served reply's rows hold together (its ids one dict's keys, its tail formed by the
    client), on rows whose values passed (`ordered`: each row's ids sorted; `mass`: the rows'
    `top_k_mass`; `actual` [R] the id each row scores): no id twice in a row; the tail's
    probability 1 - mass within `LOG_PROB_SLACK`; the token's log-prob its own top-k entry's
    (within `LOG_PROB_SLACK`) where the actual id is one of the top-k, and where it is none of
    them its probability at most the tail's (within `LOG_PROB_SLACK`: the token is part of the
    tail's mass). The row named is the first wrong one."""
    same = ordered[:, 1:] == ordered[:, :-1]
    if same.any():
        row = int(same.any(axis=1).argmax())
        return (f"topk_ids holds id {int(ordered[row, 1:][same[row]][0])} twice in row {row} (a served reply's ids are "
                f"distinct)")
    left, rest = 1.0 - mass, numpy.exp(tails)
    off = numpy.abs(rest - left) > LOG_PROB_SLACK
    if off.any():
        row = int(off.argmax())
        return (f"tail_log_probs is not log(1 - sum exp(topk_log_probs)) in row {row}: e^{float(tails[row]):.4g} = "
                f"{math.exp(tails[row]):.4g} against 1 - {float(mass[row]):.4g} = {float(left[row]):.4g}, beyond "
                f"{LOG_PROB_SLACK:g} (the client forms the tail from the top-k: teachers.tails.tail_log_probs)")
    among = ids == actual[:, None]
    slot = among.argmax(axis=1)  # the actual id's one slot (the ids are distinct), or 0 where it is none of them
    entry = numpy.take_along_axis(values, slot[:, None], axis=1)[:, 0]
    with numpy.errstate(invalid="ignore"):
        wrong = among[numpy.arange(len(slot)), slot] & (numpy.abs(entry - token) > LOG_PROB_SLACK)
    if wrong.any():
        row = int(wrong.argmax())
        slot = int(slot[row])
        return (f"token_log_probs differs from its own top-k entry in row {row}: id {int(actual[row])} scores "
                f"{float(token[row]):.6g} as the token and {float(values[row, slot]):.6g} in the top-k (a served reply "
                f"holds one entry per id)")
    above = ~among.any(axis=1) & (numpy.exp(token) - rest > LOG_PROB_SLACK)
    if above.any():
        row = int(above.argmax())
        own, rest = float(token[row]), float(tails[row])
        return (f"token_log_probs is above its row's tail in row {row}: id {int(actual[row])}, none of the top-k, "
                f"scores e^{own:.4g} = {math.exp(own):.4g} beside a tail of e^{rest:.4g} = {math.exp(rest):.4g}, "
                f"beyond {LOG_PROB_SLACK:g} (a token outside the top-k is part of the tail's mass)")
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
    empty = no_data("the hidden states", states, "are")
    if empty is not None:
        return empty
    row = first_non_finite_row(states)
    return None if row is None else f"the hidden state of row {row} is not finite"
