"""What the vocab-parallel ops share around the statistics core (:mod:`._stats`): chunk budgets,
local columns of global ids, validation, :class:`DeviceChecks` (every content check of a call
read back in one host sync) and :class:`OpSpec`, the options of one call.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from megatron_rl_patches.ops._dist import tp_size, vocab_start
# the numeric helpers the ops share live in the statistics core; re-exported for the ops' callers
from megatron_rl_patches.ops._stats import NEG_FLOOR, compute_dtype, finite_or_zero, row_scale  # noqa: F401

# Bytes of one [rows, V_local] working buffer of the compute dtype. CPU: 2 MiB (16 rows at
# V = 32000) keeps the few-buffer working set in L2/L3 while each chunk's small ops stay cheap
# next to its elementwise passes (2-core Xeon, 1 thread, V = 32000: 2-8 MiB alike, 0.25-0.5 MiB up
# to 2x slower from per-chunk overhead, 16 MiB slower again). GPU: large chunks keep kernel
# launches few; the transient memory stays far below one copy of the logits.
CPU_CHUNK_BYTES = 2 << 20
CUDA_CHUNK_BYTES = 128 << 20



# ------------------------------------------------------------------------ dtype, chunks, scale


def default_chunk_rows(n_cols: int, device: torch.device | str, dtype: torch.dtype = torch.float32) -> int:
    """Rows per chunk so that one [rows, n_cols] buffer of `dtype` fits the per-device byte budget."""
    budget = CUDA_CHUNK_BYTES if torch.device(device).type == "cuda" else CPU_CHUNK_BYTES
    row_bytes = max(1, n_cols) * torch.empty((), dtype=dtype).element_size()
    return max(1, budget // row_bytes)


def row_chunks(n_rows: int, chunk_rows: int) -> Iterator[tuple[int, int]]:
    """(start, stop) row ranges covering ``range(n_rows)`` in steps of `chunk_rows`."""
    for start in range(0, n_rows, chunk_rows):
        yield start, min(n_rows, start + chunk_rows)


def valid_local_columns(local_vocab: int, vocab_size: int | None, group: dist.ProcessGroup | None) -> int:
    """How many of this rank's columns hold real vocab ids (Megatron pads the vocab at the end)."""
    if vocab_size is None:
        return local_vocab
    return max(0, min(local_vocab, vocab_size - vocab_start(local_vocab, group)))


def local_columns(ids: torch.Tensor, first_id: int, n_valid: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Local column of global `ids`, and whether this rank owns them; ids of other ranks (and
    padding) point at column `n_valid`, a sink column of the chunk buffers, so writes need no mask."""
    local = ids.to(torch.long) - first_id
    owned = (local >= 0) & (local < n_valid)
    return torch.where(owned, local, n_valid), owned


# ------------------------------------------------------------------------ validation

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
    check_id_tensor(tokens, "tokens", "[T]")
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


def reject_double_backward(backward: Callable) -> Callable:
    """Decorator for an autograd Function's backward that is not itself differentiable: with
    `create_graph=True` (grad mode on inside backward) raise instead of returning a gradient
    silently cut from the graph (what `once_differentiable` does); else run without grad."""

    def wrapped(ctx, *grads):
        if torch.is_grad_enabled():
            raise RuntimeError(
                f"{type(ctx).__name__.removesuffix('Backward')}: backward with create_graph=True (double backward, "
                "e.g. a gradient penalty) is not supported by this op; compute the penalty on a "
                "differentiable reference, or call backward without create_graph"
            )
        return backward(ctx, *grads)

    wrapped.__name__, wrapped.__doc__ = backward.__name__, backward.__doc__
    return wrapped


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
    stalls the GPU queue each time.
    """

    def __init__(self) -> None:
        self._checks: list[tuple[torch.Tensor, Callable[[], Exception]]] = []

    def require(self, ok: torch.Tensor, error: Callable[[], Exception]) -> None:
        """Every element of the bool tensor `ok` must be true, else ``raise error()``."""
        if ok.numel():
            self._checks.append((ok.all(), error))

    def raise_first(self) -> None:
        """One host sync: raise the first failed check's error, if any; forget all checks."""
        checks, self._checks = self._checks, []
        if not checks:
            return
        device = checks[0][0].device
        failed = torch.stack([~ok.to(device) for ok, _ in checks] + [torch.ones((), dtype=torch.bool, device=device)])
        first = int(failed.to(torch.int32).argmax())  # argmax returns the first maximal index
        if first < len(checks):
            raise checks[first][1]()


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


def check_positive_int(value: object, name: str, meaning: str = "") -> int:
    """`value` as an int >= 1 (bool refused), else ValueError naming `name` (and its `meaning`)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < 1:
        raise ValueError(f"{name} must be a positive int{meaning}, got {value!r}")
    return int(value)


def check_chunk_size(chunk_size: object) -> int | None:
    if chunk_size is None:
        return None
    return check_positive_int(chunk_size, "chunk_size", " (rows per chunk) or None (byte-budget default)")


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


def check_scalar_temperature(temperature: object, dtype: torch.dtype = torch.float32, expected: str = "a float") -> float:
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


# ------------------------------------------------------------------------ the streaming core


@dataclass(frozen=True)
class OpSpec:
    """Options of one call of a vocab-parallel op (log-probs, top-k; on logits or the fused LM
    head), fixed before its autograd Function runs."""

    group: dist.ProcessGroup | None
    first_id: int  # global id of local column 0 (of local vocab row 0 of the weight)
    n_valid: int  # local columns that are real vocab ids
    chunk_rows: int | None  # rows per chunk; the fused LM head: None = its tile budget
    op: str  # the public op and its logits argument, for messages
    arg: str = "logits"
    with_entropy: bool = False
    entropy_grad: bool = False
    inplace_backward: bool = False
    sequence_parallel: bool = False  # the fused LM head's hidden rows are sharded over the group


def op_spec(
    local_vocab: int, group: dist.ProcessGroup | None, vocab_size: int | None, chunk_rows: int | None, op: str,
    **options: object,
) -> OpSpec:
    """The :class:`OpSpec` of a call on this rank's `local_vocab` columns (`vocab_size` checked)."""
    return OpSpec(group=group, first_id=vocab_start(local_vocab, group),
                  n_valid=valid_local_columns(local_vocab, vocab_size, group), chunk_rows=chunk_rows, op=op,
                  **options)  # type: ignore[arg-type]


def logits_chunk_rows(chunk_size: int | None, local_vocab: int, group: dist.ProcessGroup | None,
                      vocab_size: int | None, logits: torch.Tensor) -> int:
    """Rows per chunk of the logits ops: `chunk_size`, or the byte budget of one [rows, n_valid + 1]
    buffer of the compute dtype."""
    n_valid = valid_local_columns(local_vocab, vocab_size, group)
    return chunk_size or default_chunk_rows(n_valid + 1, logits.device, compute_dtype(logits.dtype))
