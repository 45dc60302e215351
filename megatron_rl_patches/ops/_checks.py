"""Every argument check of the vocabulary ops, in one room: type and shape checks raise
TypeError/ValueError naming the argument and what to do; checks of tensor values are queued on
a :class:`DeviceChecks` and read back with the call's one host sync. Nothing here changes an input.
"""
from __future__ import annotations

import math
import numbers
import sys
import warnings
from collections.abc import Callable, Iterable, Sequence
from types import FrameType

import torch
import torch.distributed as dist

from megatron_rl_patches._args import positive_int
from megatron_rl_patches.ops._dist import tp_size
from megatron_rl_patches.ops._divergences import DEFAULT_BETA, DEFAULT_DIVERGENCE, check_divergence
from megatron_rl_patches.ops._stats import compute_dtype

Temperature = float | torch.Tensor
Weights = torch.Tensor | Sequence[float] | None
KL_KINDS = ("reverse", "forward", "mixed")



FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# int64 and int32 are what models emit; the narrow ones are fine for ids too. The wide unsigned
# types have almost no kernels (comparisons, gather) in torch and are refused by name.
ID_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def check_float_tensor(value: object, name: str, shape_hint: str) -> torch.Tensor:
    """A floating tensor of a dtype the ops compute in (fp16/bf16/fp32/fp64), with data."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {shape_hint}, got {type(value).__name__}")
    if value.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{name} must be a floating tensor (float16/bfloat16/float32/float64), got dtype {value.dtype}; "
            f"convert it first, e.g. {name}.float()"
        )
    check_has_data(value, name)
    return value


def check_id_tensor(value: object, name: str, shape_hint: str) -> torch.Tensor:
    """An integer tensor of token ids (int64/int32/int16/int8/uint8), with data."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {shape_hint} of global token ids, got {type(value).__name__}")
    if value.dtype not in ID_DTYPES:
        raise TypeError(f"{name} must be an integer tensor of ids (int64 or int32), got dtype {value.dtype}; "
                        f"convert it with {name}.long()")
    check_has_data(value, name)
    return value


def check_tokens_shape(tokens: object, n_rows: int, device: torch.device, shape_note: str, holder: str) -> torch.Tensor:
    """Target ids: an id tensor of shape [T] on `device` (`holder` names the tensor that sets it)."""
    tokens = check_id_tensor(tokens, "tokens", "[T]")
    if tokens.shape != (n_rows,):
        raise ValueError(f"tokens must have shape [T] = ({n_rows},) {shape_note}, got {tuple(tokens.shape)}")
    if tokens.device != device:
        raise ValueError(f"tokens are on {tokens.device} but {holder} on {device}; move them together")
    return tokens


def require_tokens_in_vocab(tokens: torch.Tensor, vocab: int, checks: DeviceChecks) -> None:
    """Every target id in [0, vocab), checked through `checks` (read with the forward's host sync)."""
    outside = (tokens < 0) | (tokens >= vocab)

    def tokens_error() -> ValueError:
        bad = torch.nonzero(outside).squeeze(1)[:8].tolist()
        return ValueError(
            f"tokens must be global ids in [0, {vocab}); rows {bad} are outside (e.g. {int(tokens[bad[0]])}); "
            f"mask padding targets with a valid id such as 0 and drop those rows from the loss"
        )

    checks.require(~outside, tokens_error)


def check_keep_mask(keep_mask: object, shape: tuple[int, int], device: torch.device, holder: str) -> None:
    """None, or a bool tensor [T, V_local] on `device` (`holder` names the tensor that sets both)."""
    if keep_mask is None:
        return
    if not isinstance(keep_mask, torch.Tensor) or keep_mask.dtype != torch.bool:
        got = keep_mask.dtype if isinstance(keep_mask, torch.Tensor) else type(keep_mask).__name__
        raise TypeError(f"keep_mask must be a bool tensor [T, V_local], got {got}")
    if keep_mask.shape != shape:
        raise ValueError(f"keep_mask must have shape [T, V_local] = {tuple(shape)} (as {holder}), "
                         f"got {tuple(keep_mask.shape)}")
    if keep_mask.device != device:
        raise ValueError(f"keep_mask is on {keep_mask.device} but {holder} on {device}; move them together")


def check_row_mask(row_mask: object, n_rows: int, device: torch.device, holder: str) -> torch.Tensor | None:
    """None, or the rows an op computes: a bool tensor [T] on `device` (`holder` names the tensor
    whose rows it selects). Returned as given; nothing is copied."""
    if row_mask is None:
        return None
    if not isinstance(row_mask, torch.Tensor) or row_mask.dtype != torch.bool:
        got = f"dtype {row_mask.dtype}" if isinstance(row_mask, torch.Tensor) else type(row_mask).__name__
        raise TypeError(f"row_mask must be a bool tensor [T] (True: compute this row), got {got}; "
                        f"build it with e.g. response_mask.bool()")
    if row_mask.shape != (n_rows,):
        raise ValueError(f"row_mask must have shape [T] = ({n_rows},), one flag per row of {holder}, "
                         f"got {tuple(row_mask.shape)}; flatten [b, s] masks with row_mask.reshape(-1)")
    if row_mask.device != device:
        raise ValueError(f"row_mask is on {row_mask.device} but {holder} on {device}; move them together")
    return row_mask


def check_has_data(value: torch.Tensor, name: str) -> None:
    """Meta tensors have a shape but no values: nothing can be computed from them."""
    if value.device.type == "meta":
        raise ValueError(f"{name} is on the meta device (a shape without data); pass a materialized tensor")


def check_inplace_target(logits: torch.Tensor) -> None:
    """`inplace_backward=True` writes the gradient into the logits' storage: refuse storage a
    leaf owns (a leaf, or a view of one, e.g. a parameter or `leaf.view(...)`) and rows or
    columns that overlap in memory (stride 0), for every T."""
    base = logits._base if logits._base is not None else logits
    if (logits.requires_grad and logits.is_leaf) or (base.requires_grad and base.is_leaf):
        raise ValueError(
            "inplace_backward=True would overwrite a leaf tensor's values (the logits are a leaf or a view of "
            "one) with its gradient; use it only for logits produced by the model (a non-leaf), or pass "
            "inplace_backward=False"
        )
    n_rows, local_vocab = logits.shape
    overlapping_cols = local_vocab > 1 and logits.stride(1) != 1
    overlapping_rows = n_rows > 1 and logits.stride(0) < local_vocab
    if overlapping_cols or overlapping_rows:
        raise ValueError(
            f"inplace_backward=True needs logits whose elements do not overlap in memory "
            f"(strides {logits.stride()}); pass logits.contiguous() or inplace_backward=False"
        )


def bad_row_codes(raw_max: torch.Tensor) -> torch.Tensor:
    """Per row: BAD_NONFINITE for NaN/+inf logits (raw_max maps NaN to +inf), BAD_ALL_NEG_INF for
    rows without any finite logit, else 0."""
    return torch.where(torch.isposinf(raw_max), BAD_NONFINITE, torch.where(torch.isneginf(raw_max), BAD_ALL_NEG_INF, 0))


BAD_NONFINITE, BAD_ALL_NEG_INF, BAD_KEPT_NEG_INF = 1, 2, 3
BAD_MESSAGES = {
    BAD_NONFINITE: "contain NaN or +inf (finite values and -inf are accepted)",
    BAD_ALL_NEG_INF: "are entirely -inf (no token has any probability)",
    BAD_KEPT_NEG_INF: "have only -inf logits among the kept ids (keep_mask plus the target)",
}


def bad_rows_error(op: str, name: str, bad: torch.Tensor) -> ValueError:
    """ValueError naming the first bad rows of `name` (every rank sees the same codes)."""
    first = int(torch.nonzero(bad)[0, 0])
    code = int(bad[first])
    rows = torch.nonzero(bad == code).squeeze(1)[:8].tolist()
    return ValueError(
        f"{op}: {name} rows {rows} {BAD_MESSAGES[code]} ({int((bad != 0).sum())} bad row(s) in total); "
        f"fix the {name} of those rows before the loss"
    )


class DeviceChecks:
    """Content checks (ranges, signs, NaN rows) read back with one host sync for all of them.

    ``require`` keeps a device-side flag; ``raise_first`` syncs once and raises the first failed
    check's error (built only then, so messages may inspect the data). A host sync per check
    stalls the GPU queue each time. ``warn_unless`` queues a warning read back with the same sync.
    """

    _MAX_WARNINGS = 16  # their flags travel as bits of the one integer read back

    def __init__(self) -> None:
        self._checks: list[tuple[torch.Tensor, Callable[[], Exception]]] = []
        self._warnings: list[tuple[torch.Tensor, Callable[[], Warning]]] = []

    def require(self, ok: torch.Tensor, error: Callable[[], Exception]) -> None:
        """Every element of the bool tensor `ok` must be true, else ``raise error()``."""
        if ok.numel():
            self._checks.append((ok.all(), error))

    def warn_unless(self, ok: torch.Tensor, warning: Callable[[], Warning]) -> None:
        """Every element of `ok` should be true, else ``warnings.warn(warning())`` at the sync."""
        if ok.numel():
            if len(self._warnings) == self._MAX_WARNINGS:
                raise RuntimeError(f"DeviceChecks holds at most {self._MAX_WARNINGS} warnings per call")
            self._warnings.append((ok.all(), warning))

    def raise_first(self, read: torch.Tensor | None = None) -> list[int]:
        """One host sync: raise the first failed check's error, if any, else issue every failed
        warning (as called from the op's caller); forget all checks. `read` (an integer or bool
        tensor the op needs on the host) comes back in the same copy, as a flat list."""
        checks, self._checks = self._checks, []
        notes, self._warnings = self._warnings, []
        if not checks and not notes:
            return [] if read is None else read.reshape(-1).to("cpu", torch.int64, copy=True).tolist()
        device = (checks or notes)[0][0].device
        failed = torch.stack([~ok.to(device) for ok, _ in checks] + [torch.ones((), dtype=torch.bool, device=device)])
        code = failed.to(torch.int64).argmax()  # argmax returns the first maximal index
        if notes:  # the warnings' flags as bits above the index: still one number to read back
            bits = torch.stack([~ok.to(device) for ok, _ in notes]).to(torch.int64)
            code = code + (len(checks) + 1) * (bits << torch.arange(len(notes), device=device)).sum()
        if read is None:
            host = [int(code)]
        else:  # the number and `read` in one copy
            host = torch.cat([code.reshape(1), read.reshape(-1).to(device, torch.int64)]).to("cpu", copy=True).tolist()
        first, flags = divmod(host[0], len(checks) + 1)[::-1]
        if first < len(checks):
            raise checks[first][1]()
        for index, (_, warning) in enumerate(notes):
            if flags >> index & 1:
                warnings.warn(warning(), stacklevel=caller_stacklevel())
        return host[1:]


def caller_stacklevel() -> int:
    """`warnings.warn`'s stacklevel, for its caller, that names the first frame outside this
    package and torch (an op's caller, also from inside an autograd Function)."""
    frame: FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None and frame.f_globals.get("__name__", "").partition(".")[0] in ("megatron_rl_patches",
                                                                                         "torch"):
        frame, level = frame.f_back, level + 1
    return level


def check_group(group: dist.ProcessGroup | None) -> None:
    """A tensor-parallel group needs torch.distributed initialized (None: no tensor parallelism)."""
    if group is not None and not (dist.is_available() and dist.is_initialized()):
        raise ValueError("tp_group was given but torch.distributed is not initialized; pass tp_group=None")


def global_vocab(local_vocab: int, group: dist.ProcessGroup | None, vocab_size: object) -> int:
    """The global vocabulary size (`vocab_size`, checked, or V_local x tensor-parallel size)."""
    padded = local_vocab * tp_size(group)
    if vocab_size is None:
        return padded
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, numbers.Integral):
        raise TypeError(f"vocab_size must be an int or None, got {type(vocab_size).__name__}")
    if not 1 <= int(vocab_size) <= padded:
        raise ValueError(
            f"vocab_size must be in [1, {padded}] (V_local {local_vocab} x tensor-parallel size "
            f"{tp_size(group)}): pass the unpadded global vocabulary size, got {vocab_size}"
        )
    return int(vocab_size)


def check_chunk_size(chunk_size: object) -> int | None:
    if chunk_size is None:
        return None
    return positive_int("chunk_size", chunk_size, " (rows per chunk) or None (byte-budget default)")


def smallest_temperature(dtype: torch.dtype = torch.float32) -> float:
    """The smallest temperature whose 1/τ is finite in the compute dtype (float32 unless fp64)."""
    return 1.0 / torch.finfo(compute_dtype(dtype)).max


def check_temperature(
    temperature: object, lead: Sequence[int], device: torch.device, checks: DeviceChecks,
    dtype: torch.dtype = torch.float32,
) -> float | torch.Tensor:
    """A float, or a tensor of shape [] or `lead` (one value per token) flattened to [T].

    Values (finite, > 0, and 1/τ finite in the compute dtype of `dtype` inputs) of a tensor are
    checked through `checks`; a temperature that requires grad is rejected: it is a sampling
    constant, and no gradient is computed for it.
    """
    lead = tuple(lead)
    if isinstance(temperature, torch.Tensor):
        return _check_temperature_tensor(temperature, lead, device, checks, dtype)
    return check_scalar_temperature(temperature, dtype, f"a float or a tensor of shape {list(lead)}")


def check_scalar_temperature(temperature: object, dtype: torch.dtype = torch.float32,
                             expected: str = "a float") -> float:
    """A real number temperature as a float: finite, > 0, and 1/τ finite in the compute dtype of
    `dtype` inputs; else TypeError/ValueError naming it (`expected` describes what is accepted)."""
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real):
        raise TypeError(f"temperature must be {expected}, got {type(temperature).__name__}")
    try:
        value = float(temperature)
    except OverflowError:  # a Python int (or Fraction) beyond float range, e.g. 10**400
        raise ValueError(
            "temperature must be finite and > 0, got a number beyond the float range (|temperature| >= 2**1024); "
            "pass a float"
        ) from None
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"temperature must be finite and > 0, got {value}")
    math_dtype = compute_dtype(dtype)
    if 1.0 / value > torch.finfo(math_dtype).max:  # host arithmetic: no device sync
        raise ValueError(
            f"temperature must be >= {smallest_temperature(dtype):.6g} (the smallest whose 1/temperature is finite "
            f"in {math_dtype}), got {value}"
        )
    return value


def _check_temperature_tensor(
    temperature: torch.Tensor, lead: tuple[int, ...], device: torch.device, checks: DeviceChecks, dtype: torch.dtype
) -> torch.Tensor:
    """A per-token temperature tensor: its form here, its values (finite, > 0, 1/τ finite in the
    compute dtype) through `checks`; flattened to [T] (shape [] kept)."""
    math_dtype = compute_dtype(dtype)
    smallest = smallest_temperature(dtype)
    if not temperature.is_floating_point():
        raise TypeError(f"temperature must be a float or a floating tensor, got dtype {temperature.dtype}")
    if temperature.shape not in ((), lead):
        raise ValueError(
            f"temperature tensor must have shape [] or {list(lead)} (one value per token), "
            f"got {list(temperature.shape)}"
        )
    if temperature.requires_grad:
        raise ValueError("temperature must not require grad (it is a sampling constant); pass .detach()")
    if temperature.device != device:
        raise ValueError(f"temperature is on {temperature.device} but the logits on {device}; move it there")
    check_has_data(temperature, "temperature")
    flat = temperature.reshape(-1) if temperature.dim() else temperature
    checks.require(
        torch.isfinite(flat) & (flat > 0),
        lambda: ValueError("temperature must be finite and > 0 for every token; check the per-token temperatures"),
    )
    checks.require(
        torch.isfinite(1.0 / flat.to(math_dtype)),
        lambda: ValueError(
            f"temperature must be >= {smallest:.6g} for every token (smaller ones make 1/temperature overflow "
            f"{math_dtype}); check the per-token temperatures"
        ),
    )
    return flat



# ------------------------------------------------------------------------ top-k and the OPD loss
def check_logits(logits: object, name: str, tp_group: dist.ProcessGroup | None) -> tuple[torch.Size, int]:
    logits = check_float_tensor(logits, name, "of shape [T, V_local]")
    if logits.dim() < 2 or logits.shape[-1] == 0:
        raise ValueError(
            f"{name} must have shape [T, V_local] (or [..., V_local]) with V_local > 0, got {tuple(logits.shape)}"
        )
    check_group(tp_group)
    return logits.shape[:-1], logits.shape[-1]


def check_k(k: int, vocab: int, name: str = "k") -> None:
    if k >= vocab:
        raise ValueError(
            f"{name} must be smaller than the vocabulary size {vocab} (global, after vocab_size) so that "
            f"the tail bucket is not empty, got {k}; use a smaller k"
        )


def check_ids(ids: object, lead: torch.Size, vocab: int, checks: DeviceChecks, ids_mask: object = None) -> int:
    """k of ids [*lead, k]; with `ids_mask` (bool, ids' shape) only the True slots are checked
    (in range, no repeats within a row): the others are padding, whatever their value."""
    ids = check_id_tensor(ids, "ids", "[T, k]")
    if ids.dim() != len(lead) + 1 or ids.shape[:-1] != lead or ids.shape[-1] == 0:
        raise ValueError(
            f"ids must have shape {tuple(lead) + ('k',)} (the logits' leading dims, then k >= 1), "
            f"got {tuple(ids.shape)}"
        )
    k = ids.shape[-1]
    check_k(k, vocab, "ids.shape[-1] (k)")
    ids_mask = check_ids_mask(ids_mask, ids)
    inside = (ids >= 0) & (ids < vocab)
    if ids_mask is not None:
        inside |= ~ids_mask
    checks.require(inside, lambda: ValueError(
        f"ids must be global vocab ids in [0, {vocab}), found {ids[~inside][0].item()}; check vocab_size and tp_group"
        + ("" if ids_mask is None else " (only slots where ids_mask is True are read)")
    ))
    if k > 1:
        distinct = ids.to(torch.long)
        if ids_mask is not None:  # padding as distinct values no id has
            distinct = torch.where(ids_mask, distinct, vocab + torch.arange(k, device=ids.device))
        ordered = distinct.sort(dim=-1).values
        checks.require(ordered[..., 1:] != ordered[..., :-1], lambda: ValueError(
            "ids must not repeat within a row (each id is one bucket); deduplicate them, e.g. use topk_ids"
        ))
    return k


def check_ids_mask(ids_mask: object, ids: torch.Tensor, name: str = "ids") -> torch.Tensor | None:
    """None, or a bool tensor of `ids`' shape and device (True: a real id; False: padding)."""
    if ids_mask is None:
        return None
    if not isinstance(ids_mask, torch.Tensor) or ids_mask.dtype != torch.bool:
        raise TypeError(f"ids_mask must be a bool tensor (True: a real id, False: padding) or None, "
                        f"got {type(ids_mask).__name__ if not isinstance(ids_mask, torch.Tensor) else ids_mask.dtype}")
    if ids_mask.shape != ids.shape or ids_mask.device != ids.device:
        raise ValueError(f"ids_mask must have {name}' shape {tuple(ids.shape)} and device {ids.device}, "
                         f"got {tuple(ids_mask.shape)} on {ids_mask.device}")
    return ids_mask


def check_int_k(k: object) -> int:
    return positive_int("k", k)


def check_logprob_values(values: torch.Tensor, name: str, checks: DeviceChecks) -> None:
    """Log-probabilities: <= 0 and not NaN; -inf (probability 0) is legal."""
    ok = values <= 0  # False at NaN and +inf
    checks.require(ok, lambda: ValueError(
        f"{name} must be log-probabilities (<= 0, -inf allowed, no NaN or +inf); found "
        f"{values[~ok].flatten()[0].item()} at {torch.nonzero(~ok)[0].tolist()}; pass log-probs, not logits"
    ))


def check_teachers(
    teacher_logprobs: object, teacher_tail_logprobs: object, ids_shape: torch.Size, checks: DeviceChecks
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Teacher tensors as [n, *ids_shape] and [n, *ids_shape[:-1]] (tail None when derived);
    their values (log-probabilities) checked through `checks`."""
    teacher_logprobs = check_float_tensor(teacher_logprobs, "teacher_logprobs", "[n_teachers, T, k] or [T, k]")
    if teacher_logprobs.shape == ids_shape:
        teacher_logprobs = teacher_logprobs.unsqueeze(0)
        single = True
    elif teacher_logprobs.dim() == len(ids_shape) + 1 and teacher_logprobs.shape[1:] == ids_shape:
        single = False
    else:
        raise ValueError(
            f"teacher_logprobs must have shape {tuple(ids_shape)} (one teacher) or "
            f"(n_teachers, *{tuple(ids_shape)}), like ids; got {tuple(teacher_logprobs.shape)}"
        )
    if teacher_logprobs.shape[0] == 0:
        raise ValueError("teacher_logprobs must hold at least one teacher, got n_teachers = 0")
    check_logprob_values(teacher_logprobs.detach(), "teacher_logprobs", checks)
    if teacher_tail_logprobs is None:
        return teacher_logprobs, None
    teacher_tail_logprobs = check_float_tensor(
        teacher_tail_logprobs, "teacher_tail_logprobs", "[n_teachers, T] or [T], or None"
    )
    expected = tuple(teacher_logprobs.shape[:-1])[1:] if single else tuple(teacher_logprobs.shape[:-1])
    if tuple(teacher_tail_logprobs.shape) != expected:
        raise ValueError(
            f"teacher_tail_logprobs must have shape {expected} to match teacher_logprobs "
            f"{tuple(teacher_logprobs.shape[1:] if single else teacher_logprobs.shape)}, "
            f"got {tuple(teacher_tail_logprobs.shape)}"
        )
    check_logprob_values(teacher_tail_logprobs.detach(), "teacher_tail_logprobs", checks)
    tail = teacher_tail_logprobs.unsqueeze(0) if single else teacher_tail_logprobs
    return teacher_logprobs, tail


_WEIGHT_SUM_TOLERANCE = 1e-6  # how far from 1 the teachers' mixture weights may sum


def _read_weights(weights: object, n: int, device: torch.device) -> tuple[torch.Tensor, list[float] | None]:
    """The weights as float64 [n] on `device`, and their host values when they came as numbers
    (an iterator is read once); TypeError for a str (not read as digits) or non-numbers."""
    if isinstance(weights, torch.Tensor):
        check_has_data(weights, "teacher_weights")
        w = weights.detach().to(device=device, dtype=torch.float64)
        values = None
    else:
        try:
            if isinstance(weights, (str, bytes)):
                raise TypeError
            values = [float(x) for x in weights]  # type: ignore[attr-defined]
        except (TypeError, ValueError):
            raise TypeError(
                f"teacher_weights must be a sequence of {n} numbers or a tensor [{n}], got {weights!r}"
            ) from None
        w = torch.tensor(values, dtype=torch.float64, device=device)
    if w.shape != (n,):
        raise ValueError(f"teacher_weights must have shape ({n},), one weight per teacher, got {tuple(w.shape)}")
    return w, values


def check_weights(weights: Weights | Iterable[float], n: int, dtype: torch.dtype, device: torch.device,
                  checks: DeviceChecks, *, renormalize_for_one_release: bool = False) -> torch.Tensor:
    """Log of the teachers' mixture weights [n] (equal when None). The one policy of every op: the
    weights are the mixture's probabilities, finite, >= 0 and summing to 1 within 1e-6, never
    renormalized silently. `renormalize_for_one_release` (topk_kl / topk_opd_loss, which used to
    renormalize): a sum != 1 is divided out with a FutureWarning (read with the call's one sync);
    the next release refuses it."""
    if weights is None:
        return torch.full((n,), -math.log(n), dtype=dtype, device=device)
    w, values = _read_weights(weights, n, device)
    shown = values if values is not None else w  # the message reads a tensor only when it is raised
    checks.require(torch.isfinite(w) & (w >= 0), lambda: ValueError(
        f"teacher_weights must be finite and >= 0, got {_listed(shown)}"
    ))
    total = w.sum()
    checks.require(total > 0, lambda: ValueError(
        "teacher_weights must not all be zero: give at least one teacher a positive weight"
    ))
    checks.require(torch.isfinite(total), lambda: ValueError(
        f"teacher_weights must have a finite sum (got {_listed(shown)}, whose sum overflows); divide them by "
        "their sum"
    ))
    if renormalize_for_one_release:
        def renormalized() -> FutureWarning:  # reads no tensor: a warning costs no second sync
            total_text = f"sum to {sum(values):g}, not 1" if values is not None else "do not sum to 1"
            return FutureWarning(
                f"teacher_weights {total_text}: divided by their sum today, a ValueError in the next release "
                "(the weights are the mixture's probabilities); pass weights / sum(weights)"
            )

        if values is None:
            checks.warn_unless(~torch.isfinite(total) | (total <= 0) | ((total - 1).abs() <= _WEIGHT_SUM_TOLERANCE),
                               renormalized)
        elif 0 < sum(values) < math.inf and not abs(math.fsum(values) - 1) <= _WEIGHT_SUM_TOLERANCE:
            warnings.warn(renormalized(), stacklevel=caller_stacklevel())
        return torch.log(w / total).to(dtype)

    def not_one() -> ValueError:
        return ValueError(f"teacher_weights must sum to 1 (the mixture's probabilities), got {_listed(shown)} "
                          f"(sum {sum(_listed(shown)):g}); divide them by their sum")

    if values is not None:  # numbers on the host: no device sync to wait for
        if math.isfinite(sum(values)) and not abs(math.fsum(values) - 1) <= _WEIGHT_SUM_TOLERANCE:
            raise not_one()
    else:
        checks.require((total - 1).abs() <= _WEIGHT_SUM_TOLERANCE, not_one)
    return torch.log(w / total).to(dtype)


def _listed(values: list[float] | torch.Tensor) -> list[float]:
    return values if isinstance(values, list) else [float(x) for x in values.tolist()]


def check_mixture(
    teacher_logprobs: object, teacher_tail: object, bucket_shape: torch.Size, weights: Weights,
    dtype: torch.dtype, device: torch.device, checks: DeviceChecks,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The teachers' buckets ([n, ..., k], tails or None) and the log mixture weights [n]."""
    teachers, tails = check_teachers(teacher_logprobs, teacher_tail, bucket_shape, checks)
    return teachers, tails, check_weights(weights, teachers.shape[0], dtype, device, checks,
                                          renormalize_for_one_release=True)


def check_kl_options(kl: object, mix: object) -> float:
    if not isinstance(kl, str) or kl not in KL_KINDS:
        raise ValueError(f"kl must be one of {KL_KINDS}, got {kl!r}")
    if isinstance(mix, bool) or not isinstance(mix, numbers.Real) or not 0.0 <= float(mix) <= 1.0:
        raise ValueError(f"mix must be a float in [0, 1] (the forward-KL share of kl='mixed'), got {mix!r}")
    return float(mix)


_KL_NAMES = {"reverse": "reverse_kl", "forward": "forward_kl", "mixed": "mixed_kl"}


def resolve_divergence(divergence: object, beta: object, alpha: object, kl: object,
                       mix: object) -> tuple[str, float, float]:
    """(name, β, α) of the top-k losses' divergence arguments. `divergence=` supersedes the
    deprecated `kl=`/`mix=`: giving both is a TypeError; `kl=`/`mix=` alone warn
    (DeprecationWarning) and map to reverse_kl / forward_kl / mixed_kl with β = 1 − mix (mix was
    the forward share); nothing given is reverse_kl."""
    legacy = [name for name, value in (("kl", kl), ("mix", mix)) if value is not None]
    if divergence is not None and legacy:
        raise TypeError(f"give divergence= or the deprecated {'/'.join(n + '=' for n in legacy)}, not both; "
                        f"divergence= supersedes them (kl='forward' is divergence='forward_kl')")
    if not legacy:
        return check_divergence(DEFAULT_DIVERGENCE if divergence is None else divergence, beta, alpha)
    warnings.warn("kl=/mix= are deprecated: use divergence= ('reverse_kl', 'forward_kl', 'mixed_kl', 'jsd', ...); "
                  "kl='reverse' is divergence='reverse_kl', kl='forward' divergence='forward_kl', "
                  "kl='mixed', mix=m divergence='mixed_kl', beta=1 - m",
                  DeprecationWarning, stacklevel=3)
    mix = check_kl_options("reverse" if kl is None else kl, 1.0 - DEFAULT_BETA if mix is None else mix)
    _, beta, alpha = check_divergence(DEFAULT_DIVERGENCE, beta, alpha)
    assert kl is None or isinstance(kl, str)  # check_kl_options accepted it
    name = _KL_NAMES["reverse" if kl is None else kl]
    return name, (1.0 - mix if name == "mixed_kl" else beta), alpha



# ------------------------------------------------------------------------ the fused LM head


def check_lm_head_inputs(hidden, weight, tp_group, sequence_parallel, vocab_size, chunk_size) -> tuple[int, int, int]:
    """(local rows, global rows, global vocab); TypeError/ValueError naming the argument."""
    check_float_tensor(hidden, "hidden", "[T, H] (under sequence parallelism this rank's [T/tp, H])")
    check_float_tensor(weight, "weight", "[V_local, H] (this rank's vocab shard of the output weight)")
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be 2-D [T, H], got shape {tuple(hidden.shape)}; flatten [s, b, h] first")
    if weight.dim() != 2 or weight.size(1) != hidden.size(1) or weight.size(0) == 0:
        raise ValueError(
            f"weight must be [V_local, H] with H = {hidden.size(1)} (hidden's last dim) and V_local > 0, "
            f"got shape {tuple(weight.shape)}"
        )
    if weight.dtype != hidden.dtype or weight.device != hidden.device:
        raise ValueError(
            f"hidden and weight must share dtype and device, got {hidden.dtype}/{hidden.device} and "
            f"{weight.dtype}/{weight.device}"
        )
    if not isinstance(sequence_parallel, bool):
        raise TypeError(f"sequence_parallel must be True or False, got {sequence_parallel!r}")
    check_group(tp_group)
    check_chunk_size(chunk_size)
    vocab = global_vocab(weight.size(0), tp_group, vocab_size)
    rows = hidden.size(0) * (tp_size(tp_group) if sequence_parallel else 1)
    return hidden.size(0), rows, vocab


# ------------------------------------------------------------------------ log-probs on logits


def check_logprobs_inputs(
    logits, tokens, tp_group, temperature, chunk_size, keep_mask, vocab_size, inplace_backward
) -> tuple[DeviceChecks, float | torch.Tensor]:
    """Raise TypeError/ValueError naming the argument; checks of tensor values come back deferred
    (read with the forward's one host sync). Returns them and the checked temperature."""
    check_float_tensor(logits, "logits", "[T, V_local]")
    if logits.dim() != 2:
        raise ValueError(
            f"logits must be 2-D [T, V_local], got shape {tuple(logits.shape)}; flatten batch/sequence "
            f"dims first, e.g. logits.reshape(-1, logits.size(-1))"
        )
    n_rows, local_vocab = logits.shape
    check_tokens_shape(tokens, n_rows, logits.device, f"to match logits {tuple(logits.shape)}", "logits")
    check_group(tp_group)
    if local_vocab == 0:
        raise ValueError("logits have no vocab columns (V_local = 0)")
    vocab = global_vocab(local_vocab, tp_group, vocab_size)
    checks = DeviceChecks()
    require_tokens_in_vocab(tokens, vocab, checks)
    temperature = check_temperature(temperature, (n_rows,), logits.device, checks, logits.dtype)
    check_chunk_size(chunk_size)
    check_keep_mask(keep_mask, logits.shape, logits.device, "the logits")
    if inplace_backward:
        check_inplace_target(logits)
    return checks, temperature




# ------------------------------------------------------------------------ full-vocabulary divergences
class VocabularyMismatchError(ValueError):
    """A teacher's output weight does not share the student's vocabulary or TP sharding."""


def check_divergence_options(divergence: object, beta: object, alpha: object) -> tuple[str, float, float]:
    """(name, β, α) checked by the divergence family's one check (named errors, see _divergences)."""
    return check_divergence(divergence, beta, alpha)


def _as_models(value: object, name: str) -> tuple[list[object], bool]:
    if isinstance(value, torch.Tensor):
        return [value], True
    if isinstance(value, (list, tuple)):
        return list(value), False
    raise TypeError(f"{name} must be a tensor (one teacher) or a list/tuple of tensors (several), "
                    f"got {type(value).__name__}")


def check_teacher_models(teacher_hidden: object, teacher_weight: object, hidden: torch.Tensor, weight: torch.Tensor,
                         checks: DeviceChecks) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """[(teacher_hidden_j, teacher_weight_j)]: each [T, H_t] / [V_local, H_t] with the student's rows,
    vocabulary shard and device; VocabularyMismatchError for another V_local; finite hidden
    states checked through `checks`."""
    hs, single_h = _as_models(teacher_hidden, "teacher_hidden")
    ws, single_w = _as_models(teacher_weight, "teacher_weight")
    if single_h != single_w or len(hs) != len(ws) or not hs:
        raise ValueError(f"teacher_hidden and teacher_weight must both be one tensor or sequences of the same "
                         f"length >= 1 (one pair per teacher), got {len(hs)} hidden and {len(ws)} weights")
    models = []
    for j, (h, w) in enumerate(zip(hs, ws)):
        hn, wn = ("teacher_hidden", "teacher_weight") if single_h else (f"teacher_hidden[{j}]", f"teacher_weight[{j}]")
        h = check_float_tensor(h, hn, "[T, H_t] (the teacher's final hidden states, rows as hidden's)")
        w = check_float_tensor(w, wn, "[V_local, H_t] (the teacher's vocab shard of its output weight)")
        if h.dim() != 2 or h.shape[0] != hidden.shape[0]:
            raise ValueError(f"{hn} must be [T, H_t] with T = {hidden.shape[0]} (hidden's rows, the same tokens), "
                             f"got shape {tuple(h.shape)}")
        if w.dim() != 2 or w.shape[1] != h.shape[1]:
            raise ValueError(f"{wn} must be [V_local, H_t] with H_t = {h.shape[1]} ({hn}'s last dim), "
                             f"got shape {tuple(w.shape)}")
        if w.shape[0] != weight.shape[0]:
            raise VocabularyMismatchError(
                f"{wn} holds {w.shape[0]} vocabulary rows but the student's weight {weight.shape[0]}: every model "
                f"must share the vocabulary and its tensor-parallel sharding (same padded size, same tp); pad or "
                f"re-shard the teacher's output weight like the student's")
        if h.dtype != w.dtype or h.device != hidden.device or w.device != hidden.device:
            raise ValueError(f"{hn} and {wn} must share one dtype and the student's device {hidden.device}, got "
                             f"{h.dtype}/{h.device} and {w.dtype}/{w.device}")
        def nonfinite(hn: str = hn) -> ValueError:
            return ValueError(f"{hn} has non-finite values (NaN or inf); the teacher's forward diverged: "
                              f"check its inputs and weights")
        checks.require(torch.isfinite(h), nonfinite)
        models.append((h, w))
    return models
