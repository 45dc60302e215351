"""Byte-exact chunks between two tokenizations of the same bytes: a chunk is the span between
two consecutive common boundaries (byte offsets where both sides end a token), so it covers the
same bytes on both sides with at least one token of each, and no common boundary inside."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from megatron_rl_patches.cross_tokenizer.arguments import as_index_list

__all__ = ["Alignment", "align"]


@dataclass(frozen=True)
class Alignment:
    """Chunk index per token: `student_chunk` int64 [n_student] (−1: a student token excluded
    from the alignment, see the counts), `teacher_chunk` int64 [n_teacher]; chunks numbered from
    0 in byte order. Counts of excluded student tokens: `invalid_utf8` (tokens of bytes that are
    not valid UTF-8), `unspelled` (the teacher's encoding does not spell those bytes: a
    normalizer), `unmapped_special` (special tokens with no teacher equal)."""

    student_chunk: torch.Tensor
    teacher_chunk: torch.Tensor
    n_chunks: int
    invalid_utf8: int = 0
    unspelled: int = 0
    unmapped_special: int = 0

    @property
    def n_excluded(self) -> int:
        """Student tokens with chunk −1 (masked in every cross-tokenizer loss)."""
        return int((self.student_chunk < 0).sum())

    def chunk_starts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(student token, teacher token) [n_chunks] each: the first token of every chunk, where
        both models predict the same next bytes."""
        return _firsts(self.student_chunk, self.n_chunks), _firsts(self.teacher_chunk, self.n_chunks)

    def sizes(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(student tokens, teacher tokens) per chunk, int64 [n_chunks] each."""
        return _counts(self.student_chunk, self.n_chunks), _counts(self.teacher_chunk, self.n_chunks)


def _counts(chunk: torch.Tensor, n: int) -> torch.Tensor:
    kept = chunk[chunk >= 0]
    return torch.bincount(kept, minlength=n)


def _firsts(chunk: torch.Tensor, n: int) -> torch.Tensor:
    position = torch.arange(chunk.numel(), dtype=torch.int64)
    kept = chunk >= 0
    first = torch.full((n,), chunk.numel(), dtype=torch.int64)
    return first.scatter_reduce(0, chunk[kept], position[kept], "amin")


def _ends(pieces: Sequence[bytes]) -> np.ndarray:
    return np.cumsum(np.fromiter((len(p) for p in pieces), dtype=np.int64, count=len(pieces)))


def _check_pieces(pieces: object, name: str) -> list[bytes]:
    if isinstance(pieces, (bytes, str)) or not isinstance(pieces, Sequence):
        raise TypeError(f"{name} must be a list of bytes (one per token, e.g. from token_bytes), "
                        f"got {type(pieces).__name__}")
    for i, p in enumerate(pieces):
        if not isinstance(p, (bytes, bytearray)):
            raise TypeError(f"{name}[{i}] must be bytes, got {type(p).__name__}; use token_bytes(tokenizer, ids)")
    return list(pieces)


def align(student_bytes: Sequence[bytes], teacher_bytes: Sequence[bytes], *,
          boundaries: Sequence[int] = ()) -> Alignment:
    """The chunks of two tokenizations whose bytes join to the same string. `boundaries`: student
    token indices where a chunk must start (the prompt/response boundary, a loss-mask change);
    the teacher must have a token boundary at the same byte."""
    student = _check_pieces(student_bytes, "student_bytes")
    teacher = _check_pieces(teacher_bytes, "teacher_bytes")
    s_ends, t_ends = _ends(student), _ends(teacher)
    total_s = int(s_ends[-1]) if s_ends.size else 0
    total_t = int(t_ends[-1]) if t_ends.size else 0
    if total_s != total_t or b"".join(student) != b"".join(teacher):
        raise ValueError(f"student_bytes ({total_s} bytes) and teacher_bytes ({total_t} bytes) do not join to the "
                         "same bytes; align two tokenizations of one text (retokenize builds the teacher's)")
    forced = _forced_offsets(boundaries, s_ends, t_ends)
    return chunks_from_ends(s_ends, t_ends, forced, None)


def _forced_offsets(boundaries: Sequence[int], s_ends: np.ndarray, t_ends: np.ndarray) -> np.ndarray:
    n = s_ends.size
    marks = as_index_list(boundaries, "boundaries")
    if any(b < 0 or b > n for b in marks):
        raise ValueError(f"boundaries must be student token indices in [0, {n}], got {marks}")
    offsets = np.concatenate([np.zeros(1, np.int64), s_ends])[np.asarray(marks, dtype=np.int64)]
    missing = np.setdiff1d(offsets, np.concatenate([np.zeros(1, np.int64), t_ends]))
    if missing.size:
        raise ValueError(f"boundaries: the teacher has no token boundary at byte offsets {missing[:8].tolist()}; "
                         "encode the teacher's text in segments split there (retokenize(..., boundaries=) does)")
    return offsets


def chunks_from_ends(s_ends: np.ndarray, t_ends: np.ndarray, forced: np.ndarray, excluded: np.ndarray | None,
                     **counts: int) -> Alignment:
    """Alignment from the end offsets of the kept student tokens (`excluded` marks the others,
    chunk −1, in a longer student list) and the teacher's, with forced common boundaries. A token's
    chunk: the one holding its first byte; an empty token joins the chunk of the next byte (the
    last chunk at the very end)."""
    total = int(s_ends[-1]) if s_ends.size else 0
    if total:
        size = max(total, int(t_ends[-1]) if t_ends.size else 0) + 1
        on_teacher = np.zeros(size, dtype=bool)
        on_teacher[t_ends] = True
        is_common = np.zeros(size, dtype=bool)  # the byte offsets both sides end a token at, 0, the end, forced
        is_common[s_ends] = on_teacher[s_ends]
        is_common[forced] = True
        is_common[[0, total]] = True
        before = np.cumsum(is_common) - 1  # per offset: the chunk starting at or before it
        n_chunks = int(before[total])
        s_chunk = np.minimum(before[np.concatenate([np.zeros(1, np.int64), s_ends[:-1]])], n_chunks - 1)
        t_starts = np.concatenate([np.zeros(1, np.int64), t_ends[:-1]]) if t_ends.size else t_ends
        t_chunk = np.minimum(before[t_starts], n_chunks - 1)
    else:  # no bytes: one chunk if both sides hold (empty) tokens
        n_chunks = int(bool(s_ends.size and t_ends.size))
        s_chunk = np.full(s_ends.size, n_chunks - 1, np.int64)
        t_chunk = np.full(t_ends.size, n_chunks - 1, np.int64)
    if excluded is not None:
        full = np.full(excluded.size, -1, dtype=np.int64)
        full[~excluded] = s_chunk
        s_chunk = full
    return Alignment(torch.from_numpy(s_chunk.astype(np.int64)), torch.from_numpy(t_chunk.astype(np.int64)),
                     int(n_chunks), **counts)
