"""A `TeacherHead` re-cut to another padded vocabulary (`head_padded_as`): a full-vocabulary
divergence compares the teacher's output layer with the student's row by row, so both must hold
the same vocabulary rows on each tensor-parallel rank. A student whose padded vocabulary differs
from the one the head was read at (another `--make-vocab-size-divisible-by`, a framework that pads
otherwise) gets the head's real rows at its own layout and zero rows past them."""
from __future__ import annotations

import dataclasses
import numbers

import torch

from megatron_rl_patches.ops.agreement import agree, gathered
from megatron_rl_patches.teachers.head.teacher_head import TeacherHead, group_position


def head_padded_as(head: TeacherHead, padded_vocab_size: int) -> TeacherHead:
    """`head` with `padded_vocab_size` rows over its tensor-parallel group (this rank's equal
    shard); unchanged when it already has them. Every rank of the head's group calls it (one
    all-gather of the shards, once: the whole [V, H] lives on each rank for the copy). ValueError
    when the padded vocabulary cannot hold the head's real one or does not split over the group."""
    rank, size = group_position(head.tp_group)
    error: Exception | None = None
    asked = -1  # what the group compares where no int was given (that rank's error is raised then)
    if isinstance(padded_vocab_size, bool) or not isinstance(padded_vocab_size, numbers.Integral):
        error = TypeError(f"head_padded_as(padded_vocab_size=...) must be an int (the student's padded vocabulary: "
                          f"its output layer's rows over the tensor-parallel group), got "
                          f"{type(padded_vocab_size).__name__} {padded_vocab_size!r:.40}")
    else:
        asked = int(padded_vocab_size)
        if asked < head.vocab_size or asked % size:
            error = ValueError(f"head_padded_as(padded_vocab_size={asked}): a teacher head of {head.vocab_size} real "
                               f"rows ({head.source}) cannot be padded to {asked} rows over {size} tensor-parallel "
                               "ranks: the student's padded vocabulary must hold the teacher's real one and split "
                               "evenly over its tensor-parallel group")
    # agreed before the all-gather: a rank asking another size would otherwise return early or wait
    agree(head.tp_group, "head_padded_as", error=error,
          match={"padded_vocab_size": asked, "head_padded_vocab_size": head.padded_vocab_size},
          where="the teacher head's tensor-parallel group")
    padded_vocab_size = asked
    if head.padded_vocab_size == padded_vocab_size:
        return head
    whole = torch.cat(gathered(head.tp_group, head.weight)) if size > 1 else head.weight
    rows = padded_vocab_size // size
    first = rank * rows
    weight = head.weight.new_zeros((rows, head.hidden_size))
    real = whole[first:min(first + rows, head.vocab_size)]
    weight[:real.shape[0]] = real
    return dataclasses.replace(head, weight=weight, padded_vocab_size=padded_vocab_size, first_id=first)
