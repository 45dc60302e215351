"""A teacher with another tokenizer, described without its model: both tokenizers, their shared
vocabulary and the map of special tokens, loaded once and used for every sample of a run."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from megatron_rl_patches.cross_tokenizer.loading import load_tokenizer
from megatron_rl_patches.cross_tokenizer.teacher_passes import TeacherSample, teacher_sample
from megatron_rl_patches.cross_tokenizer.vocabulary import SharedVocabulary, shared_strings


@dataclass(frozen=True)
class CrossTeacher:
    """The tokenizer side of a teacher with another tokenizer: its tokenizer, the student's, the
    byte strings both vocabularies spell (`shared_strings`) and `stop_tokens`, a function mapping a
    student special id to the teacher's id or None (None: specials mapped by content)."""

    tokenizer: Any
    student_tokenizer: Any
    shared: SharedVocabulary
    stop_tokens: Callable[[int], int | None] | None = None

    def sample(self, tokens: torch.Tensor, response_length: int,
               loss_mask: Sequence[int] | torch.Tensor) -> TeacherSample:
        """The teacher's sample of the student's `tokens` (`teacher_sample` with this pair)."""
        return teacher_sample(tokens, response_length, loss_mask, self.student_tokenizer, self.tokenizer,
                              self.stop_tokens)


def cross_teacher(student_tokenizer: Any, teacher_tokenizer: Any,
                  stop_tokens: Callable[[int], int | None] | None = None) -> CrossTeacher:
    """The pair read once: each tokenizer a `tokenizers.Tokenizer`, a tokenizer.json path or a
    checkpoint directory (`load_tokenizer`), and their shared vocabulary."""
    student = load_tokenizer(student_tokenizer, "student_tokenizer")
    teacher = load_tokenizer(teacher_tokenizer, "teacher_tokenizer")
    return CrossTeacher(teacher, student, shared_strings(student, teacher), stop_tokens)
