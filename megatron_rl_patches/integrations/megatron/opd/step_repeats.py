"""The student's step ids when an id repeats in a row (framework-free; slime's OPD uses it): the step
scores the same-tokenizer ids and each other-tokenizer teacher's bucket ids side by side
(`topk_teachers.place`), and those parts share ids whenever the teachers agree with the student (its
top id is often a teacher's top string's), but the top-k op scores each id of a row once (its tail
is one minus their sum). A repeat is scored once: masked in the step's mask, and its column read
from the first column holding the id (`restored`)."""
from __future__ import annotations

import torch


def unrepeated(ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """([R, W] mask with each id's later slots of a row off, [R, W] int64: per such slot the first
    column holding its id, else -1) of step ids [R, W] and their mask (one sort per row)."""
    mask = mask.to(torch.bool)
    columns = torch.arange(ids.shape[-1], device=ids.device).expand_as(ids)
    key = torch.where(mask, ids.to(torch.long), -1 - columns)  # a masked slot: a value of its own
    ordered, order = key.sort(dim=-1, stable=True)  # equal ids: their columns in order
    repeat = torch.cat([torch.zeros_like(ordered[:, :1], dtype=torch.bool), ordered[:, 1:] == ordered[:, :-1]], 1)
    run_start = torch.where(repeat, torch.zeros_like(columns), columns).cummax(dim=-1).values
    first = torch.where(repeat, order.gather(1, run_start), torch.full_like(order, -1))
    same_as = torch.empty_like(first).scatter_(1, order, first)
    return mask & (same_as < 0), same_as


def restored(values: torch.Tensor, mask: torch.Tensor, same_as: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's [N, W] per-column values and mask with each repeated slot given its first
    column's value (and gradient) and counted again: what each part of the row reads."""
    same_as = same_as.to(values.device)
    repeated = same_as >= 0
    first = values.gather(1, same_as.clamp(min=0))
    return torch.where(repeated, first, values), mask | repeated
