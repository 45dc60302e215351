"""The shared vocabulary of two tokenizers: every (student id, teacher id) pair whose tokens have
identical bytes, grouped per byte string (a string can repeat inside one vocabulary: a
byte-fallback `<0xNN>` and a merged single-byte token, special tokens)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from megatron_rl_patches.cross_tokenizer.spelling import ByteTable, table_of

__all__ = ["SharedVocabulary", "shared_strings", "shared_vocabulary"]


@dataclass(frozen=True)
class SharedVocabulary:
    """The byte strings both vocabularies spell, numbered 0..n_strings−1 in byte order:
    `student_string` / `teacher_string` int64 [V] the string of each id (−1: not shared), and each
    string's ids (`student_ids` / `teacher_ids` sorted by string, with `*_offsets` [n_strings+1])."""

    strings: list[bytes]
    student_string: torch.Tensor
    teacher_string: torch.Tensor
    student_ids: torch.Tensor
    student_offsets: torch.Tensor
    teacher_ids: torch.Tensor
    teacher_offsets: torch.Tensor

    @property
    def n_strings(self) -> int:
        return len(self.strings)

    def most_ids(self, side: str) -> int:
        """The most ids one shared string has on `side` ("student" or "teacher"; at least 1)."""
        offsets = self._side(side)[1]
        return max(int(offsets.diff().max()) if offsets.numel() > 1 else 1, 1)

    def _side(self, side: str) -> tuple[torch.Tensor, torch.Tensor]:
        if side not in ("student", "teacher"):
            raise ValueError(f"side must be 'student' or 'teacher', got {side!r}")
        return (self.student_ids, self.student_offsets) if side == "student" else (self.teacher_ids,
                                                                                   self.teacher_offsets)

    def string_of(self, ids: torch.Tensor, side: str) -> torch.Tensor:
        """The shared string of each id on `side` (same shape; −1: not shared, or an id past the
        vocabulary: an output layer's padded rows)."""
        self._side(side)  # a ValueError for another name
        table = (self.student_string if side == "student" else self.teacher_string).to(ids.device)
        inside = (ids >= 0) & (ids < table.numel())
        return torch.where(inside, table[torch.where(inside, ids, 0)], -1)

    def bucket_ids(self, strings: torch.Tensor, alive: torch.Tensor, side: str, depth: int | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """For buckets `strings` [R, k] (the `alive` ones; others padding), every id of each string on
        `side`: ids [R, k·D] and their mask, D = `depth` or the most ids one chosen string has."""
        ids, offsets = self._side(side)
        ids, offsets = ids.to(strings.device), offsets.to(strings.device)
        safe = torch.where(alive, strings, 0)
        count = torch.where(alive, offsets[safe + 1] - offsets[safe], 0)
        if depth is None:
            depth = max(int(count.max()) if count.numel() else 1, 1)
        slot = torch.arange(depth, device=strings.device)
        mask = slot < count[..., None]
        index = torch.where(mask, offsets[safe][..., None] + slot, 0)
        return ids[index].reshape(*strings.shape[:-1], -1), mask.reshape(*strings.shape[:-1], -1)

    def pairs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every (student id, teacher id) pair of identical bytes, sorted by student then teacher id."""
        per_id = self.teacher_offsets.diff()[self.student_string[self.student_ids]]  # teacher ids per student id
        s_rep = torch.repeat_interleave(self.student_ids, per_id)
        first = torch.repeat_interleave(self.teacher_offsets[self.student_string[self.student_ids]], per_id)
        group_start = torch.repeat_interleave(per_id.cumsum(0) - per_id, per_id)
        within = torch.arange(int(per_id.sum()), dtype=torch.int64) - group_start
        t_rep = self.teacher_ids[first + within]
        order = torch.argsort(s_rep * (int(self.teacher_string.numel()) + 1) + t_rep)
        return s_rep[order], t_rep[order]


def _groups(table: ByteTable, index: dict[bytes, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # an id with no bytes predicts no bytes: never shared
    string = torch.tensor([index.get(piece, -1) if piece else -1 for piece in table.spelled], dtype=torch.int64)
    ids = torch.nonzero(string >= 0).squeeze(1)
    ids = ids[torch.argsort(string[ids], stable=True)]
    offsets = torch.zeros(len(index) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(torch.bincount(string[ids], minlength=len(index)), 0)
    return string, ids, offsets


def shared_strings(student_tokenizer: Any, teacher_tokenizer: Any) -> SharedVocabulary:
    """The shared vocabulary grouped per byte string (cached per tokenizer pair)."""
    student = table_of(student_tokenizer, "student_tokenizer")
    teacher = table_of(teacher_tokenizer, "teacher_tokenizer")
    return student.cached("shared", teacher, lambda: _shared(student, teacher))


def _shared(student: ByteTable, teacher: ByteTable) -> SharedVocabulary:
    common = sorted({p for p in student.spelled if p} & {p for p in teacher.spelled if p})
    index = {p: k for k, p in enumerate(common)}
    s_string, s_ids, s_off = _groups(student, index)
    t_string, t_ids, t_off = _groups(teacher, index)
    return SharedVocabulary(common, s_string, t_string, s_ids, s_off, t_ids, t_off)


def shared_vocabulary(student_tokenizer: Any, teacher_tokenizer: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(student_ids, teacher_ids): equal-length int64, every pair of ids whose tokens have
    identical bytes (complete: a string with a student ids and b teacher ids gives a·b pairs)."""
    return shared_strings(student_tokenizer, teacher_tokenizer).pairs()
