"""The exchange behind score_at_layout / topk_at_layout: every member of a teacher replica (its
tp x pp ranks: `TeacherGroups.replica_group`) checks its input and arguments, then tells the others
its input's shape, whether its checks passed and the arguments that must match, in one all-gather
(ops.agreement: a failure anywhere is the same error on every member, none is left waiting); then
the members' micro-batches are right-padded and concatenated in rank order, the same batch on
every member."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from megatron_rl_patches.inference.teacher_layout.groups import TeacherGroups
from megatron_rl_patches.ops import agreement


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


def _check_tensor(name: str, value: Any, dims: int) -> None:
    if not isinstance(value, torch.Tensor) or value.dim() != dims or value.dtype not in (torch.int64, torch.int32):
        got = (f"{value.dtype} of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor)
               else type(value).__name__)
        shape = "[rows, length, k]" if dims == 3 else "[rows, length]"
        raise TypeError(f"{name} must be an integer tensor {shape} (int64 or int32), got {got}")


def _check_ids_in(name: str, value: torch.Tensor, bound: int, where: torch.Tensor | None = None) -> None:
    """ValueError naming the first id of `value` outside [0, bound) (its sample, position and id)."""
    outside = (value < 0) | (value >= bound)
    if where is not None:
        outside &= where
    if bool(outside.any()):
        first = [int(i) for i in outside.nonzero()[0]]
        slot = f", slot {first[2]}" if len(first) > 2 else ""
        raise ValueError(f"{name}[{', '.join(map(str, first))}] = {int(value[tuple(first)])} (sample {first[0]}, "
                         f"position {first[1]}{slot}) is outside the teacher's vocabulary [0, {bound}) "
                         f"({int(outside.sum())} such id(s)); pass ids of the teacher's tokenizer")


def check_inputs(tokens: Any, others: dict[str, Any], token_vocab: int, vocab: int) -> None:
    """This rank's input checked: TypeError / ValueError naming what is wrong. `others`, name -> a
    tensor of the tokens' [rows, length] shape (labels) or of [rows, length, k] (ids, ids_mask);
    tokens are ids of the teacher's embedding (< `token_vocab`), labels and ids of its scored
    vocabulary (< `vocab`; ids only where `ids_mask` is True)."""
    _check_tensor("tokens", tokens, 2)
    for name, value in others.items():
        if name == "ids_mask":
            continue
        _check_tensor(name, value, 2 if name == "labels" else 3)
        if tuple(value.shape[:2]) != tuple(tokens.shape):
            raise ValueError(f"tokens {tuple(tokens.shape)} and {name} {tuple(value.shape)} differ in [rows, length]")
    mask = others.get("ids_mask")
    if mask is not None and (not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool
                             or mask.shape != others["ids"].shape):
        got = f"{mask.dtype} {tuple(mask.shape)}" if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise TypeError(f"ids_mask must be a bool tensor of the ids' shape {tuple(others['ids'].shape)}, got {got}")
    _check_ids_in("tokens", tokens, token_vocab)
    for name, value in others.items():
        if name != "ids_mask":
            _check_ids_in(name, value, vocab, mask if name == "ids" else None)


def agree(groups: TeacherGroups, what: str, tokens: Any, others: dict[str, Any], error: Exception | None,
          match: dict[str, Any]) -> GroupBatch:
    """Every replica member's shapes, once every member's checks passed (`error`: what this rank's
    raised, or None) and its `match` values (the arguments that shape the replica's work) equal the
    others': one all-gather over the replica (agreement.agree); else the same error on every member,
    naming the ranks."""
    wide = [value for name, value in others.items() if name not in ("labels", "ids_mask")]
    given = error is None and tokens is not None
    shape = (int(tokens.shape[0]), int(tokens.shape[1]), int(wide[0].shape[2]) if wide else 0) if given else (0, 0, 0)
    ranks = groups.replica_ranks()
    every = agreement.agree(groups.replica_group, what, error=error, match=match, where="the teacher replica",
                            share=dict(zip(("rows", "length", "width"), shape)))
    shapes = [(int(member["rows"]), int(member["length"]), int(member["width"])) for member in every]
    widths = {k for rows, _, k in shapes if rows > 0}
    if len(widths) > 1:
        raise ValueError(f"{what}: the ranks of the teacher replica {ranks} pass ids of different k "
                         f"({sorted(widths)}): pass the same k on every rank")
    # no member has rows: nothing is scored, each keeps its own k (its empty result's width)
    return GroupBatch([(rows, length) for rows, length, _ in shapes], widths.pop() if widths else shape[2])


def gathered(groups: TeacherGroups, value: torch.Tensor, batch: GroupBatch) -> torch.Tensor:
    """The group's [rows_i, length_i, ...] tensors right-padded (zeros) to the longest and
    concatenated in rank order: [sum rows_i, max length_i, ...]."""
    rows, length = max(r for r, _ in batch.shapes), max(s for _, s in batch.shapes)
    trailing = (batch.k,) if value.dim() == 3 else ()
    mine = torch.zeros(rows, length, *trailing, dtype=torch.int64)
    if value.numel():
        mine[: value.shape[0], : value.shape[1]] = value
    every = agreement.gathered(groups.replica_group, mine)
    return torch.cat([part[:r] for part, (r, _) in zip(every, batch.shapes)])
