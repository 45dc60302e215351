"""plan_shared_prefix's arguments read by value and bounded: its ids (none negative), its `pad_to`
(a padding no larger than the stream) and its `hints` (by value: a tensor's ints, never the tensor
object as a dictionary key)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def no_negative_id(ids: torch.Tensor, bounds: list[int]) -> None:
    """A negative id refused by name, with its row and sequence (the embedding's bare IndexError
    otherwise, where an id past the vocabulary is named)."""
    if ids.numel() and int(ids.min()) < 0:
        row = int((ids < 0).nonzero()[0, 0])
        sequence = sum(1 for bound in bounds[1:] if bound <= row)
        where = f"sequence {sequence}" if sequence < len(bounds) - 1 else "the padding past cu_seqlens[-1]"
        raise ValueError(f"plan_shared_prefix: tokens hold a negative id ({int(ids[row])}) at packed row {row} "
                         f"({where}): ids must be 0 to the vocabulary's size - 1; pack the ids the model embeds")


PAD_TO_FLOOR = 2 ** 16  # pad_to may pass a short stream's length up to here (a tensor-parallel size always does)


def bounded_pad_to(pad_to: int, length: int) -> int:
    """pad_to, at most the packed stream's length (or 65,536): its padding (up to pad_to - 1 rows)
    never outgrows the stream (2**62 ended in torch's storage overflow)."""
    if pad_to > max(length, PAD_TO_FLOOR):
        raise ValueError(f"plan_shared_prefix: pad_to={pad_to} would pad the physical stream by up to {pad_to - 1} "
                         f"rows, more than the {length} packed tokens and {PAD_TO_FLOOR}: pass the multiple the "
                         "stream's length must be (the tensor-parallel size under sequence parallelism)")
    return pad_to


def hint_values(hints: Any, samples: int) -> list[Any] | None:
    """The hints by value (a tensor's or a 0-d tensor's ints, never the tensor object), each one a
    dictionary key; refused by name where one is not hashable."""
    if hints is None:
        return None
    if isinstance(hints, torch.Tensor):
        if hints.dim() != 1 or hints.device.type == "meta":
            raise ValueError(f"plan_shared_prefix: hints must be one value per sample, a 1-D tensor or a sequence, "
                             f"got {tuple(hints.shape)} on {hints.device}")
        values = hints.tolist()
    elif isinstance(hints, Sequence) and not isinstance(hints, (str, bytes)):
        values = list(hints)
    else:
        raise TypeError(f"plan_shared_prefix: hints must be a sequence (or 1-D tensor) of one value per sample, got "
                        f"{type(hints).__name__}")
    if len(values) != samples:
        raise ValueError(f"plan_shared_prefix: hints must hold one entry per sample ({samples}), got {len(values)}")
    for i, hint in enumerate(values):
        if isinstance(hint, torch.Tensor):
            if hint.numel() != 1:
                raise ValueError(f"plan_shared_prefix: hints[{i}] is a tensor of {hint.numel()} values; a hint is one "
                                 "value (a claimed group index)")
            values[i] = hint = hint.item()
        try:
            hash(hint)
        except TypeError:
            raise TypeError(f"plan_shared_prefix: hints[{i}] is a {type(hint).__name__} ({hint!r:.60}), not hashable: "
                            "a hint is one value per sample, e.g. its claimed group index") from None
    return values
