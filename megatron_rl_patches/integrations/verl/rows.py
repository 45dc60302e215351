"""verl (0.9.x): on the fused log-prob route only the rows verl reads meet the output weight.

verl's engine `forward_step` packs a micro-batch (nested `input_ids`, prompt then response per
sample) and reads the log-probs and entropy of the responses only: `no_padding_2_padding` takes,
per sequence, the `resp_len` rows before its last one; a loss reads the rows its `loss_mask`
selects. The fused forward (`fused_forward_model_engine_inner`) gets no response spans, so:

1. `forward_step` is wrapped to note which rows of each sequence are read (:func:`read_rows`):
   the response rows of `no_padding_2_padding` (when the batch has "prompts" and "responses"),
   and the rows the loss mask selects, in either alignment (position t read at row t, or at row
   t - 1 where it is the next token). A batch with neither gives no selection (every row).
2. verl's own `preprocess_thd_engine`, when it packs the labels (`need_roll=True`), packs those
   rows with the same arguments less the roll (context-parallel layout, fp8 and bucket padding):
   the row mask lines up with the packed hidden states row for row; padding rows are never
   selected. (verl's roll is its own business: on one CP rank it rolls the packed buffer as a
   whole, so a sequence's last label is the next sequence's first token; no reader uses it.)
3. the fused processor passes it as `row_mask`: unselected rows are 0 with no gradient.

`MEGATRON_RL_PATCHES_VERL_ROWS=all` turns the selection off (a custom loss reading other rows).
"""
# lazy imports: import cost: the start-up hook loads this module with MEGATRON_RL_PATCHES=all (test_lazy_import)
from __future__ import annotations

import contextvars
from collections.abc import Iterator
from typing import Any

from megatron_rl_patches import settings

# The rows verl reads in the current forward_step and the micro-batch's sequence lengths: a flat
# bool [total] on the host, row-aligned with its nested input_ids (see :func:`read_rows`); None:
# every row. Not an argument: verl's preprocess_thd_engine(input_ids, pre_process, need_roll) packs the
# labels with verl's own fixed arguments, which carry no rows read.
_PENDING: contextvars.ContextVar[Any] = contextvars.ContextVar("megatron_rl_patches_verl_rows", default=None)
# The packed row mask of the current fused forward, shaped like the packed labels; None: every row.
# Not an argument: verl's model forward calls fused_output_processor(hidden_states=, output_layer=, labels=,
# context=, ...) with its fixed keywords.
_PACKED: contextvars.ContextVar[Any] = contextvars.ContextVar("megatron_rl_patches_verl_row_mask", default=None)


def _lengths(value: Any) -> list[int]:
    return [int(n) for n in value.offsets().diff().tolist()]


def read_rows(batch: Any) -> Any:
    """[total] bool on the host, the rows of the micro-batch's nested `input_ids` end to end: row r
    of a sequence (the row predicting token r + 1) is True when verl may read it; None when the
    batch says nothing about it (every row is computed) or is not in verl's nested (no-padding)
    layout. Built with whole-batch host ops: nothing per sequence reaches the device."""
    import torch

    input_ids = batch.get("input_ids", None) if hasattr(batch, "get") else None
    if not isinstance(input_ids, torch.Tensor) or not input_ids.is_nested:
        return None
    lengths = torch.tensor(_lengths(input_ids), dtype=torch.long)
    ends = lengths.cumsum(0)
    total = int(ends[-1]) if len(ends) else 0
    rows = torch.zeros(total, dtype=torch.bool)
    told = False
    responses = response_lengths(batch)
    if responses is not None:  # no_padding_2_padding's slice: the resp_len rows before the last
        told = True
        first = torch.maximum(ends - 1 - torch.tensor(responses, dtype=torch.long), ends - lengths)
        some = first < ends - 1
        # the intervals [first, last) marked by +1 / -1 and a running sum (one pass over the rows)
        edges = torch.zeros(total + 1, dtype=torch.int32)
        edges.index_add_(0, first[some], torch.ones(int(some.sum()), dtype=torch.int32))
        edges.index_add_(0, ends[some] - 1, torch.full((int(some.sum()),), -1, dtype=torch.int32))
        rows |= edges.cumsum(0, dtype=torch.int32)[:total] > 0
    loss_mask = batch.get("loss_mask", None)
    if isinstance(loss_mask, torch.Tensor) and loss_mask.is_nested and _lengths(loss_mask) == lengths.tolist():
        told = True
        mask = loss_mask.values().to(device="cpu", dtype=torch.bool)
        rows |= mask  # position t read at row t
        following = torch.zeros_like(mask)
        following[:-1] = mask[1:]  # token t + 1 read at row t ...
        following[ends[lengths > 0] - 1] = False  # ... within the sequence
        rows |= following
    return rows if told else None


def response_lengths(batch: Any) -> list[int] | None:
    """Per sequence, the response length `no_padding_2_padding` slices (or None: no responses):
    the nested `responses`' lengths, or the padded `attention_mask`'s count past the prompts."""
    import torch

    prompts, responses = batch.get("prompts", None), batch.get("responses", None)
    if not isinstance(prompts, torch.Tensor) or not isinstance(responses, torch.Tensor):
        return None
    if responses.is_nested:
        return _lengths(responses)
    attention_mask = batch.get("attention_mask", None)
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.is_nested:
        return None
    return [int(n) for n in attention_mask[:, prompts.shape[1]:].sum(dim=1).tolist()]


class _Noting(Iterator[Any]):
    """`batch_iter` as forward_step takes it: each micro-batch's read rows noted as it is taken."""

    def __init__(self, inner: Iterator[Any]) -> None:
        self._inner = inner

    def __next__(self) -> Any:
        batch = next(self._inner)
        rows = read_rows(batch)
        _PENDING.set(None if rows is None else (rows, _lengths(batch["input_ids"])))
        return batch


def forward_step_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper on `MegatronEngineWithLMHead.forward_step(batch_iter, model, ...)`."""
    if settings.verl_rows():  # read at verl's forward_step, its door
        return wrapped(*args, **kwargs)
    batch_iter = args[0] if args else kwargs.get("batch_iter")
    if batch_iter is None or not hasattr(batch_iter, "__iter__"):
        return wrapped(*args, **kwargs)  # not verl's call: its own error
    if args:
        args = (_Noting(iter(batch_iter)),) + tuple(args[1:])
    else:
        kwargs = dict(kwargs, batch_iter=_Noting(iter(batch_iter)))
    pending, packed = _PENDING.set(None), _PACKED.set(None)
    try:
        return wrapped(*args, **kwargs)
    finally:
        _PENDING.reset(pending)
        _PACKED.reset(packed)


def packer_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper on verl's `preprocess_thd_engine`: packing the labels (need_roll=True) in a
    noted forward_step packs the read rows alike (unrolled), for the fused processor."""
    result = wrapped(*args, **kwargs)
    pending = _PENDING.get()
    if pending is None or not kwargs.get("need_roll", False) or not args:
        return result
    rows, lengths_read = pending
    labels = args[0]
    if getattr(labels, "is_nested", False) and _lengths(labels) == lengths_read:
        import torch

        # the flags are per row, i.e. per input position as the hidden states are packed: the
        # labels' arguments without their roll (verl rolls the labels alone)
        values = rows.to(device=labels.device, dtype=labels.dtype)
        flags = torch.nested.nested_tensor_from_jagged(values, offsets=labels.offsets())
        packed = wrapped(flags, *args[1:], **dict(kwargs, need_roll=False))[0]
        _PACKED.set(packed != 0)
    return result


def packed_row_mask(labels: Any) -> Any:
    """The current fused forward's row mask if it lines up with the processor's `labels`, else None."""
    mask = _PACKED.get()
    if mask is None or getattr(labels, "shape", None) != mask.shape:
        return None
    return mask
