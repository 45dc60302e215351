"""The samples a teacher scores (`TeacherBatch`): whole token sequences and where each one's
response starts. Every response row is scored given the whole prefix before it."""
from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TeacherBatch:
    """`sequences`: 1-D integer id tensors (prompt + response); `response_starts`: the first
    response position of each (>= 1: position 0 has nothing before it). Sample i has
    R_i = len(sequences[i]) - response_starts[i] rows (0 allowed)."""

    sequences: list[torch.Tensor]
    response_starts: list[int]

    def __post_init__(self) -> None:
        if not isinstance(self.sequences, (list, tuple)):
            raise TypeError(f"TeacherBatch(sequences=...) must be a list of 1-D id tensors, got "
                            f"{type(self.sequences).__name__}")
        if not isinstance(self.response_starts, (list, tuple)):
            raise TypeError(f"TeacherBatch(response_starts=...) must be a list of ints, got "
                            f"{type(self.response_starts).__name__}")
        if len(self.sequences) != len(self.response_starts):
            raise ValueError(f"TeacherBatch: {len(self.sequences)} sequences but {len(self.response_starts)} "
                             f"response_starts: give one start per sequence")
        for i, (ids, start) in enumerate(zip(self.sequences, self.response_starts)):
            check_sequence(i, ids)
            check_start(i, start, len(ids))
        object.__setattr__(self, "sequences", list(self.sequences))
        object.__setattr__(self, "response_starts", [int(s) for s in self.response_starts])

    def __len__(self) -> int:
        return len(self.sequences)

    def response_rows(self, sample: int) -> int:
        """R_i: the number of response rows of sample `sample`."""
        return len(self.sequences[sample]) - self.response_starts[sample]


def check_sequence(sample: int, ids: object) -> None:
    """Sample `sample`'s ids: a 1-D integer tensor of non-negative ids."""
    if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.dtype.is_floating_point or ids.is_complex() \
            or ids.dtype == torch.bool:
        shown = f"a tensor of shape {tuple(ids.shape)} and dtype {ids.dtype}" if isinstance(ids, torch.Tensor) \
            else type(ids).__name__
        hint = " (torch.tensor(ids) makes one)" if isinstance(ids, (list, tuple)) else ""
        raise TypeError(f"TeacherBatch: sequences[{sample}] must be a 1-D integer id tensor, got {shown}{hint}")
    if ids.device.type == "meta":
        raise ValueError(f"TeacherBatch: sequences[{sample}] is on the meta device (a shape without data): give the "
                         f"ids themselves")
    if ids.numel() and int(ids.min()) < 0:
        raise ValueError(f"TeacherBatch: sequences[{sample}] holds a negative id ({int(ids.min())}): ids are "
                         f"vocabulary indices")


def check_start(sample: int, start: object, length: int) -> None:
    """Sample `sample`'s response start: an int in [1, length]."""
    if isinstance(start, bool) or not isinstance(start, numbers.Integral):
        raise TypeError(f"TeacherBatch: response_starts[{sample}] must be an int, got {start!r}")
    if not 1 <= int(start) <= length:
        raise ValueError(f"TeacherBatch: response_starts[{sample}] = {start} is outside [1, {length}] (sequence "
                         f"{sample} has {length} ids; position 0 has no log-prob: a response starts at 1 or later)")
