"""The chunk-start losses' inputs checked before any work: one hidden row per token of the
alignment on each side, output layers of the hidden size, and a shared vocabulary of this
(student, teacher) pair in that order (each side's vocabulary within its output layer's rows)."""
from __future__ import annotations

import torch

from megatron_rl_patches.cross_tokenizer.alignment import Alignment
from megatron_rl_patches.cross_tokenizer.vocabulary import SharedVocabulary

__all__ = ["check_loss_inputs"]


def _matrix(value: object, name: str, rows: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.dim() != 2:
        got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"{name} must be a 2-D tensor [{rows}, hidden], got {got}")
    return value


def _side(hidden: object, weight: object, tokens: int, vocabulary: int, names: tuple[str, str], side: str) -> None:
    h_name, w_name = names
    h, w = _matrix(hidden, h_name, "tokens"), _matrix(weight, w_name, "vocab")
    if h.size(0) != tokens:
        raise ValueError(f"{h_name} has {h.size(0)} rows; the alignment has {tokens} {side} tokens: pass one "
                         f"row per {side} token (row i scores token i)")
    if w.size(1) != h.size(1):
        raise ValueError(f"{w_name} {list(w.shape)} does not match {h_name}'s hidden size {h.size(1)}; pass the "
                         f"{side}'s own output layer")
    if w.size(0) < vocabulary:
        raise ValueError(f"shared: its {side} side is a vocabulary of {vocabulary} ids but {w_name} has "
                         f"{w.size(0)} rows; pass shared_strings(student_tokenizer, teacher_tokenizer) in that "
                         f"order (the swapped pair's puts the teacher's ids on the student's side) and the "
                         f"{side}'s output layer")


def check_loss_inputs(hidden: object, weight: object, teacher_hidden: object, teacher_weight: object,
                      alignment: object, shared: object) -> None:
    """A ValueError / TypeError naming the argument at fault, before any work."""
    if not isinstance(alignment, Alignment):
        raise TypeError(f"alignment must be an Alignment (from retokenize or align), got {type(alignment).__name__}")
    if not isinstance(shared, SharedVocabulary):
        raise TypeError("shared must be a SharedVocabulary (shared_strings(student_tokenizer, teacher_tokenizer)), "
                        f"got {type(shared).__name__}")
    _side(hidden, weight, alignment.student_chunk.numel(), shared.student_string.numel(), ("hidden", "weight"),
          "student")
    _side(teacher_hidden, teacher_weight, alignment.teacher_chunk.numel(), shared.teacher_string.numel(),
          ("teacher_hidden", "teacher_weight"), "teacher")
