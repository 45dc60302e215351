"""The exchange behind score_at_layout / topk_at_layout: every member of a teacher replica (its
tp x pp ranks: `TeacherGroups.replica_group`) tells the others its input's shape (or that its input
is bad: then every member raises, none is left waiting), then the members' micro-batches are
right-padded and concatenated in rank order, the same batch on every member."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron_rl_patches.inference.teacher_layout.groups import TeacherGroups


@dataclass(frozen=True)
class GroupBatch:
    """Each member's (rows, length) and the trailing width `k` of the per-token inputs (0: none)."""

    shapes: list[tuple[int, int]]
    k: int

    def real(self) -> torch.Tensor:
        """[sum rows * max length] bool: True at the real tokens of the gathered batch, False at the
        right padding (the same on every member: the ops' row_mask)."""
        longest = max(s for _, s in self.shapes)
        masks = [torch.arange(longest).lt(length).expand(rows, longest) for rows, length in self.shapes]
        return torch.cat(masks).reshape(-1)

    def my_rows(self, groups: TeacherGroups) -> tuple[int, int, int]:
        """(first row in the group's batch, rows, length) of this rank's rows."""
        position = groups.replica_rank
        first = sum(rows for rows, _ in self.shapes[:position])
        return (first, *self.shapes[position])


def _problem(name: str, value: Any, dims: int) -> str:
    if not isinstance(value, torch.Tensor) or value.dim() != dims or value.dtype not in (torch.int64, torch.int32):
        got = (f"{value.dtype} of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor)
               else type(value).__name__)
        shape = "[rows, length, k]" if dims == 3 else "[rows, length]"
        return f"{name} must be an integer tensor {shape}, got {got}"
    return ""


def local_problem(tokens: Any, others: dict[str, Any]) -> str:
    """What is wrong with this rank's input ('' when nothing): `others`, name -> a tensor of the
    tokens' [rows, length] shape (labels) or of [rows, length, k] (ids)."""
    problem = _problem("tokens", tokens, 2)
    for name, value in others.items():
        dims = 2 if name == "labels" else 3
        problem = problem or _problem(name, value, dims)
        if not problem and tuple(value.shape[:2]) != tuple(tokens.shape):
            problem = f"tokens {tuple(tokens.shape)} and {name} {tuple(value.shape)} differ in [rows, length]"
    return problem


def agree(groups: TeacherGroups, tokens: Any, others: dict[str, Any]) -> GroupBatch:
    """Every group member's shapes; ValueError on every member naming the ranks whose input is
    bad (or whose per-token width k differs)."""
    problem = local_problem(tokens, others)
    wide = [value for name, value in others.items() if name != "labels"]
    k = int(wide[0].shape[2]) if wide and not problem else 0
    mine = torch.tensor([-1, -1, -1] if problem else [int(tokens.shape[0]), int(tokens.shape[1]), k])
    ranks = groups.replica_ranks()
    every = [torch.empty_like(mine) for _ in ranks]
    dist.all_gather(every, mine, group=groups.replica_group)
    bad = [ranks[i] for i, shape in enumerate(every) if int(shape[0]) < 0]
    if bad:
        raise ValueError(f"bad tokens / labels / ids on rank(s) {bad} of the teacher replica {ranks}"
                         + (f": {problem}" if problem else ""))
    widths = {int(shape[2]) for shape in every if int(shape[0]) > 0}
    if len(widths) > 1:
        raise ValueError(f"the ranks of the teacher replica {ranks} pass ids of different k "
                         f"({sorted(widths)}): pass the same k on every rank")
    # no member has rows: nothing is scored, each keeps its own k (its empty result's width)
    return GroupBatch([(int(shape[0]), int(shape[1])) for shape in every], widths.pop() if widths else k)


def gathered(groups: TeacherGroups, value: torch.Tensor, batch: GroupBatch) -> torch.Tensor:
    """The group's [rows_i, length_i, ...] tensors right-padded (zeros) to the longest and
    concatenated in rank order: [sum rows_i, max length_i, ...]."""
    rows, length = max(r for r, _ in batch.shapes), max(s for _, s in batch.shapes)
    trailing = (batch.k,) if value.dim() == 3 else ()
    mine = torch.zeros(rows, length, *trailing, dtype=torch.int64)
    if value.numel():
        mine[: value.shape[0], : value.shape[1]] = value
    every = [torch.empty_like(mine) for _ in batch.shapes]
    dist.all_gather(every, mine, group=groups.replica_group)
    return torch.cat([part[:r] for part, (r, _) in zip(every, batch.shapes)])
