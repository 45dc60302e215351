"""One scoring pass of a teacher replica over its pipeline stages (TeacherLayout(pp=P)).

Every rank of the replica holds the same gathered batch. Stage 0 embeds it and runs its layers;
each later stage receives the previous stage's hidden states [length, rows, hidden] from the rank
at its own tensor position (torch.distributed point-to-point send / recv: without sequence
parallelism every tensor rank of a stage holds the whole hidden states, so each tensor position
is its own chain of P ranks) and runs its layers; the last stage computes the logits and scores
them (vocab-parallel over its tensor-parallel group, so each of its ranks holds every row's
scores), then broadcasts the scores over the pipeline group, so every rank of the replica holds
them all and keeps its own rows. At pp=1 the one stage runs and scores, nothing is sent.

Before its hidden states a stage sends a status (0, or 1 + the stage that failed), and the last
stage broadcasts one before the scores: a stage whose forward or scoring raises lets the others
go on and every rank of the pipeline raises (the failing rank its own error), none waits."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from megatron_rl_patches.inference.teacher_layout.groups import TeacherGroups


def _status(value: int, device: torch.device) -> torch.Tensor:
    return torch.tensor([value], dtype=torch.int64, device=device)


def _stage_output(model: Any, groups: TeacherGroups, inputs: tuple[torch.Tensor, ...],
                  hidden_size: int, dtype: torch.dtype) -> tuple[torch.Tensor | None, int, BaseException | None]:
    """(this stage's output, the status it passes on, its own error): the stage's forward on the
    previous stage's hidden states (received here) or, on the first stage, on the tokens."""
    tokens = inputs[0]
    device, stage, ranks = tokens.device, groups.pp_rank, groups.pp_ranks()
    status = _status(0, device)
    if stage > 0:
        dist.recv(status, src=ranks[stage - 1])
        if int(status.item()):
            return None, int(status.item()), None
        hidden = torch.empty(tokens.shape[1], tokens.shape[0], hidden_size, dtype=dtype, device=device)
        dist.recv(hidden, src=ranks[stage - 1])
        model.set_input_tensor(hidden)
    try:
        output = model(*inputs)
    except Exception as exc:  # the other stages are told, then every rank raises
        return None, stage + 1, exc
    finally:
        if stage > 0:
            model.set_input_tensor(None)
    return output, 0, None


def replica_scores(model: Any, groups: TeacherGroups, inputs: tuple[torch.Tensor, ...],
                   score: Callable[[torch.Tensor], list[torch.Tensor]],
                   shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    """`score(logits)` of the gathered batch `inputs` (tokens [rows, length], position ids,
    attention mask, on the model's device) on every rank of the replica: fp32 tensors of `shapes`."""
    if groups.pp_size == 1:
        return [value.float() for value in score(model(*inputs))]
    parameter = next(model.parameters())
    hidden_size = int(model.config.hidden_size)
    output, status, error = _stage_output(model, groups, inputs, hidden_size, parameter.dtype)
    stage, ranks, last = groups.pp_rank, groups.pp_ranks(), groups.pp_size - 1
    device = inputs[0].device
    values = [torch.zeros(shape, dtype=torch.float32, device=device) for shape in shapes]
    if stage < last:
        dist.send(_status(status, device), dst=ranks[stage + 1])
        if output is not None:
            dist.send(output.to(parameter.dtype).contiguous(), dst=ranks[stage + 1])
    elif output is not None:
        try:
            values = [value.float().contiguous() for value in score(output)]
        except Exception as exc:  # as a stage's forward: broadcast, then raised
            status, error = stage + 1, exc
    final = _status(status, device)
    dist.broadcast(final, src=ranks[last], group=groups.pp_group)
    failed = int(final.item())
    if error is not None:
        raise error
    if failed:
        raise RuntimeError(f"the teacher's pipeline stage {failed - 1} (rank {ranks[failed - 1]} of the pipeline "
                           f"{ranks}) failed to score the batch: see that rank's error")
    for value in values:
        dist.broadcast(value, src=ranks[last], group=groups.pp_group)
    return values
