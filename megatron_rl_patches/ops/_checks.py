"""The check primitives every vocabulary op uses: type and shape checks that raise
TypeError/ValueError naming the argument and what to do, temperature, the teachers' mixture
weights (one policy for `topk_kl` and `lm_head_divergence`), bad-row codes, and
:class:`DeviceChecks`, which queues checks of tensor values and reads them back with the call's
one host sync. Each op's own bundle lives beside it (`logprobs.check_logprobs_inputs`,
`lm_head.check_lm_head_inputs`, :mod:`.topk_checks`, :mod:`.divergence_checks`). Nothing here
changes an input.
"""
from __future__ import annotations

import functools
import math
import numbers
import struct
import sys
import warnings
from collections.abc import Callable, Iterable, Sequence
from types import FrameType

import torch
import torch.distributed as dist

from megatron_rl_patches.ops._dist import tp_size
from megatron_rl_patches.ops._dtype import compute_dtype
from megatron_rl_patches.ops._rows import scatter_rows
from megatron_rl_patches.ops.scoring_plan import positive_int

Temperature = float | torch.Tensor
Weights = torch.Tensor | Sequence[float] | None
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


def require_tokens_in_vocab(tokens: torch.Tensor, vocab: int, checks: DeviceChecks,
                            group: dist.ProcessGroup | None = None) -> None:
    """Every target id in [0, vocab), checked through `checks` (read with the forward's host sync).
    Without a TP group an id beyond the columns may mean a vocab shard passed without `tp_group`:
    the error says so, beside the padding advice."""
    outside = (tokens < 0) | (tokens >= vocab)

    def tokens_error() -> ValueError:
        bad = torch.nonzero(outside).squeeze(1)[:8].tolist()
        example = int(tokens[bad[0]])
        shard = ("; if these are one rank's vocab shard [T, V/tp] of a tensor-parallel model, pass tp_group "
                 "(the ids are global, up to V)" if group is None and example >= vocab else "")
        return ValueError(
            f"tokens must be global ids in [0, {vocab}); rows {bad} are outside (e.g. {example}){shard}; "
            f"otherwise mask padding targets with a valid id such as 0 and drop those rows from the loss"
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


def require_good_rows(checks: DeviceChecks, shift: torch.Tensor, op: str, what: str, *,
                      kept_log_sum: torch.Tensor | None = None, rows: torch.Tensor | None = None,
                      n_rows: int = 0) -> None:
    """Rows of `what` with NaN/+inf or no finite logit (from their combined max), or no finite kept
    logit (`kept_log_sum` -inf), join the call's checks, raised at its one host sync; with `rows`
    (the selected rows of `n_rows`) they are named by their row of all."""
    bad = bad_row_codes(shift)
    if kept_log_sum is not None:
        bad = torch.where((bad == 0) & torch.isneginf(kept_log_sum), BAD_KEPT_NEG_INF, bad)
    bad = scatter_rows(bad, rows, n_rows)
    checks.require(bad == 0, lambda: bad_rows_error(op, what, bad))


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


# The default mode's steps exponentiate in powers of 2, scaling by (1/τ)·log2 e; the smallest
# temperature leaves that finite in the compute dtype (with 2^-20 to spare for the roundings of 1/τ and
# of the product), so one limit holds for every path (issue 63: 1/τ alone let τ < 4.24e-39 give NaN).
_LOG2E = 1.0 / math.log(2.0)
_SPARE = 1.0 + 2.0**-20


@functools.cache
def smallest_temperature(dtype: torch.dtype = torch.float32) -> float:
    """The smallest temperature every path computes with `dtype` inputs: (1/τ)·log2 e finite in the
    compute dtype (float32 unless fp64); a value that dtype holds exactly. Host arithmetic only
    (no tensor, so an op's checks make no host sync for it)."""
    math_dtype = compute_dtype(dtype)
    bound = _LOG2E / torch.finfo(math_dtype).max * _SPARE
    if math_dtype == torch.float64:
        return bound
    (bits,) = struct.unpack("<I", struct.pack("<f", bound))  # rounded to the nearest float32
    held = struct.unpack("<f", struct.pack("<I", bits))[0]
    return held if held >= bound else struct.unpack("<f", struct.pack("<I", bits + 1))[0]


@functools.cache
def largest_temperature(dtype: torch.dtype = torch.float32) -> float:
    """The largest temperature every path computes with `dtype` inputs: its scale 1/τ a normal
    number of the compute dtype (with 2^-20 to spare). Past it the scale is subnormal (flushed to
    zero where a kernel flushes them), then 0, and the top-k log-probs and tails come out NaN (from
    about τ = 7e45 with float32: 0·(-inf)); a value that dtype holds exactly, rounded down."""
    math_dtype = compute_dtype(dtype)
    bound = 1.0 / (torch.finfo(math_dtype).tiny * _SPARE)
    if math_dtype == torch.float64:
        return bound
    (bits,) = struct.unpack("<I", struct.pack("<f", bound))  # rounded to the nearest float32
    held = struct.unpack("<f", struct.pack("<I", bits))[0]
    return held if held <= bound else struct.unpack("<f", struct.pack("<I", bits - 1))[0]


def temperature_range(dtype: torch.dtype = torch.float32) -> str:
    """The temperatures the ops compute with `dtype` inputs, in words for an error."""
    return (f"[{smallest_temperature(dtype):.6g}, {largest_temperature(dtype):.6g}] (the scale 1/temperature finite "
            f"and a normal number in {compute_dtype(dtype)})")


def check_temperature(
    temperature: object, lead: Sequence[int], device: torch.device, checks: DeviceChecks,
    dtype: torch.dtype = torch.float32,
) -> float | torch.Tensor:
    """A float, or a tensor of shape [] or `lead` (one value per token) flattened to [T].

    Values (finite, > 0, 1/τ finite and normal in the compute dtype of `dtype` inputs) of a tensor are
    checked through `checks`; a temperature that requires grad is rejected: it is a sampling
    constant, and no gradient is computed for it.
    """
    lead = tuple(lead)
    if isinstance(temperature, torch.Tensor):
        return _check_temperature_tensor(temperature, lead, device, checks, dtype)
    return check_scalar_temperature(temperature, dtype, f"a float or a tensor of shape {list(lead)}")


def check_scalar_temperature(temperature: object, dtype: torch.dtype = torch.float32,
                             expected: str = "a float") -> float:
    """A real number temperature as a float: finite, > 0, and 1/τ finite and normal in the compute
    dtype of `dtype` inputs; else TypeError/ValueError naming it (`expected` describes what is accepted)."""
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
    smallest = smallest_temperature(dtype)
    if value < smallest:  # host arithmetic: no device sync
        raise ValueError(
            f"temperature must be >= {smallest:.6g} (the smallest whose scale 1/temperature·log2(e) is finite "
            f"in {compute_dtype(dtype)}), got {value}"
        )
    largest = largest_temperature(dtype)
    if value > largest:
        raise ValueError(
            f"temperature must be <= {largest:.6g} (the largest whose scale 1/temperature is a normal number in "
            f"{compute_dtype(dtype)}: past it the top-k log-probs and tails underflow to NaN), got {value}"
        )
    return value


def _check_temperature_tensor(
    temperature: torch.Tensor, lead: tuple[int, ...], device: torch.device, checks: DeviceChecks, dtype: torch.dtype
) -> torch.Tensor:
    """A per-token temperature tensor: its form here, its values (finite, > 0, 1/τ finite in the
    compute dtype) through `checks`; flattened to [T] (shape [] kept)."""
    math_dtype = compute_dtype(dtype)
    smallest, largest = smallest_temperature(dtype), largest_temperature(dtype)
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
        flat.to(math_dtype) >= smallest,
        lambda: ValueError(
            f"temperature must be >= {smallest:.6g} for every token (smaller ones make the scale "
            f"1/temperature·log2(e) overflow {math_dtype}); check the per-token temperatures"
        ),
    )
    checks.require(
        flat.to(math_dtype) <= largest,
        lambda: ValueError(
            f"temperature must be <= {largest:.6g} for every token (larger ones make the scale 1/temperature "
            f"underflow {math_dtype}: NaN top-k log-probs and tails); check the per-token temperatures"
        ),
    )
    return flat


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


# ------------------------------------------------------------------------ full-vocabulary divergences


def collective_values(rows: int, vocab: int, temperature: float | torch.Tensor | None = None,
                      **own: bool | int | float | str | None) -> dict[str, bool | int | float | str | None]:
    """The arguments that shape an op's collective work (or combine the ranks' shards into one
    answer), named as the caller passed them, for the agreement step every op already takes at
    tp > 1 (`invariance.agreed_route`: they travel in its one all-gather, no collective more): the
    rows T, the global vocabulary, the temperature (a float; of a per-token tensor its shape: its
    values are not compared) and the op's own (`k`, `with_entropy`, ...)."""
    values: dict[str, bool | int | float | str | None] = {"the number of rows (T)": int(rows), "vocab_size": int(vocab)}
    if isinstance(temperature, torch.Tensor):
        values["temperature"] = f"a tensor of shape {tuple(temperature.shape)}"
    elif temperature is not None:
        values["temperature"] = float(temperature)
    values.update(own)
    return values
