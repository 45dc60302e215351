"""NeMo-RL's distillation batch as its teacher reads and writes it: the student's sequences and the
first row each is scored from (`rows_of`, `student_batch`), a teacher's batch in NeMo-RL's layout
(`nemo_rl_data`), and top-k rows written back at the student's positions (`filler`,
`placed_topk`, `states_of`): position s of a row holds what predicts token s + 1, as NeMo-RL's
own teacher writes it; positions no loss reads (the prompt before the first `token_mask` token,
the last token, padding) hold ids 0 .. k−1 at log(1 / (k + 1)): finite log-probs, never read
through the masks."""
from __future__ import annotations

import math
from typing import Any

import torch

from megatron_rl_patches.teachers.batch import TeacherBatch

WHERE = "ServedTeacherPolicy.get_topk_logits(data)"  # `rows_of`'s default name of the call it checks


def rows_of(data: Any, where: str = WHERE) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """`input_ids` [B, S], `input_lengths` [B] and each sample's first scored position: the first
    token `token_mask` marks (at least 1; the sample's length when it marks none), 1 without one.
    Refusals name `where` (the teacher policy's call)."""
    for key in ("input_ids", "input_lengths"):
        if key not in data:
            raise ValueError(f"{where}: data has no {key!r} (NeMo-RL's distillation batch holds input_ids, "
                             "input_lengths, token_mask)")
    ids, lengths = data["input_ids"], data["input_lengths"]
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise TypeError(f"{where}: data['input_ids'] must be a [B, S] integer tensor, got "
                        f"{getattr(ids, 'shape', type(ids).__name__)}")
    if not isinstance(lengths, torch.Tensor) or tuple(lengths.shape) != (ids.shape[0],) \
            or lengths.dtype.is_floating_point:
        raise TypeError(f"{where}: data['input_lengths'] must be a [B] = [{ids.shape[0]}] integer tensor, got "
                        f"{getattr(lengths, 'shape', type(lengths).__name__)}")
    if lengths.numel() and (int(lengths.min()) < 1 or int(lengths.max()) > ids.shape[1]):
        raise ValueError(f"{where}: data['input_lengths'] must lie in [1, {ids.shape[1]}] (the padded length), got "
                         f"{lengths.tolist()}")
    ids, lengths = ids.detach().cpu(), lengths.detach().cpu()
    mask = data["token_mask"] if "token_mask" in data else None
    if mask is not None and (not isinstance(mask, torch.Tensor) or tuple(mask.shape) != tuple(ids.shape)
                             or mask.dtype.is_floating_point and not bool(((mask == 0) | (mask == 1)).all())):
        shown = f"{tuple(mask.shape)} {mask.dtype}" if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise TypeError(f"{where}: data['token_mask'] must be a [B, S] = {list(ids.shape)} tensor of 0 / 1 "
                        f"(input_ids' shape: 1 on the tokens the loss reads), got {shown}")
    starts = []
    for i in range(ids.shape[0]):
        length = int(lengths[i])
        if mask is None:
            starts.append(1)
            continue
        marked = torch.nonzero(mask[i, 1:length].detach().cpu()).flatten()
        starts.append(int(marked[0]) + 1 if marked.numel() else length)
    return ids, lengths, starts


def student_batch(data: Any, where: str = WHERE) -> tuple[TeacherBatch, tuple[int, int]]:
    """The student's sequences of NeMo-RL's batch as a `TeacherBatch` (each scored from its first
    `token_mask` token) and the batch's [B, S]."""
    ids, lengths, starts = rows_of(data, where)
    batch = TeacherBatch(sequences=[ids[i, :int(lengths[i])] for i in range(ids.shape[0])], response_starts=starts)
    return batch, (ids.shape[0], ids.shape[1])


def filler(batch: int, seq: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, S, k] rows no loss reads: ids 0 .. k−1 at log(1 / (k + 1)) (a finite tail is left)."""
    values = torch.full((batch, seq, k), -math.log(k + 1), dtype=torch.float32)
    indices = torch.arange(k, dtype=torch.int64).expand(batch, seq, k).clone()
    return values, indices


def states_of(states: Any, starts: list[int], seq: int) -> torch.Tensor:
    """[B, S, H] of each sample's hidden states [R_i, H] at positions start − 1 .. (the state
    predicting token s + 1 at s), zeros at positions no loss reads (every one where no sample has
    a row: a sample of no rows comes as [0, H] in the dtype the states travel in)."""
    width = states[0].shape[-1] if len(states) else 0
    dtype = states[0].dtype if len(states) else torch.float32
    out = torch.zeros(len(states), seq, width, dtype=dtype)
    for i, (rows, start) in enumerate(zip(states, starts)):
        out[i, start - 1:start - 1 + rows.shape[0]] = rows.to(dtype)
    return out


def nemo_rl_data(batch: TeacherBatch) -> dict[str, torch.Tensor]:
    """NeMo-RL's distillation fields for `batch`: `input_ids` [B, S'] (zeros past each length),
    `input_lengths`, `token_mask` (1 on the response tokens) and `sample_mask`."""
    width = max((len(s) for s in batch.sequences), default=1)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros(len(batch), width)
    for i, (sequence, start) in enumerate(zip(batch.sequences, batch.response_starts)):
        ids[i, :len(sequence)] = sequence.long()
        mask[i, start:len(sequence)] = 1
    return {"input_ids": ids, "input_lengths": torch.tensor([len(s) for s in batch.sequences]),
            "token_mask": mask, "sample_mask": torch.ones(len(batch))}


def placed_topk(got: Any, batch: TeacherBatch, scored: TeacherBatch, shape: tuple[int, int], k: int,
                whose: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A `Policy`'s top-k answer over `scored` (the teacher's batch of `batch`, the student's: its
    `topk_logits` / `topk_indices` [B, S', k]) at the student's positions [B, S, k]; an answer of
    another shape refused naming `whose` get_topk_logits."""
    top_values, top_ids = got["topk_logits"], got["topk_indices"]
    if not isinstance(top_values, torch.Tensor) or top_values.dim() != 3 or top_values.shape[0] != len(batch) \
            or top_values.shape[-1] != k or top_values.shape[1] < max(len(s) for s in scored.sequences):
        shown = tuple(top_values.shape) if isinstance(top_values, torch.Tensor) else type(top_values).__name__
        raise ValueError(f"{whose} get_topk_logits answered topk_logits {shown} for a privileged batch of "
                         f"{len(batch)} samples and k={k}: expected [B, S', k]")
    values, ids = filler(*shape, k)
    for i, (start, own) in enumerate(zip(batch.response_starts, scored.response_starts)):
        rows = batch.response_rows(i)
        values[i, start - 1:start - 1 + rows] = top_values[i, own - 1:own - 1 + rows].detach().float().cpu()
        ids[i, start - 1:start - 1 + rows] = top_ids[i, own - 1:own - 1 + rows].detach().long().cpu()
    return values, ids
