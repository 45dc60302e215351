"""score_at_layout: the student's rows on each rank scored by a teacher built at its own layout.

Every rank of a teacher tensor-parallel group must run the same forward on the same tokens, but
each holds its own student micro-batch: the group's micro-batches are gathered (rows padded on
the right to the longest, concatenated in rank order), the teacher runs once on them, and each
rank keeps the log-probs of its own rows (every rank of the group holds the whole result after
the vocab-parallel reduction, so nothing is sent back). Right padding never changes a real
token's score: attention is causal."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megatron_rl_patches.inference.teacher_layout.groups import TeacherGroups
from megatron_rl_patches.inference.teacher_layout.layout import TeacherLayout


def _groups_of(chunks: Any, layout: TeacherLayout | None) -> tuple[torch.nn.Module, TeacherGroups]:
    if isinstance(chunks, torch.nn.Module):
        chunks = [chunks]
    if not isinstance(chunks, (list, tuple)) or len(chunks) != 1 or not isinstance(chunks[0], torch.nn.Module):
        raise TypeError("chunks must be the one-chunk list that build_inference_model_from_hf(layout=...) returns "
                        f"(or its chunk), got {type(chunks).__name__}")
    groups = getattr(chunks[0], "teacher_groups", None)
    if not isinstance(groups, TeacherGroups):
        raise ValueError("chunks were not built at a teacher layout: build them with "
                         "build_inference_model_from_hf(path, layout=TeacherLayout(tp=N))")
    if layout is not None and layout != groups.layout:
        raise ValueError(f"layout={layout!r} differs from the layout the chunks were built at ({groups.layout!r})")
    return chunks[0], groups


def _local_problem(tokens: Any, labels: Any) -> str:
    """What is wrong with this rank's input ('' when nothing): told to the whole group before any
    forward, so a bad input on one rank is refused on every rank, not left to hang the others."""
    for name, value in (("tokens", tokens), ("labels", labels)):
        if not isinstance(value, torch.Tensor) or value.dim() != 2 or value.dtype not in (torch.int64, torch.int32):
            return f"{name} must be an integer tensor [rows, length], got " + (
                f"{value.dtype} of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor)
                else type(value).__name__)
    if tokens.shape != labels.shape:
        return f"tokens {tuple(tokens.shape)} and labels {tuple(labels.shape)} differ in shape"
    return ""


def _agree(groups: TeacherGroups, tokens: Any, labels: Any) -> list[tuple[int, int]]:
    """Every group member's (rows, length); ValueError on every rank naming the ranks whose input is bad."""
    problem = _local_problem(tokens, labels)
    shape = [-1, -1] if problem else [int(tokens.shape[0]), int(tokens.shape[1])]
    mine = torch.tensor(shape, dtype=torch.int64)
    every = [torch.empty_like(mine) for _ in range(groups.tp_size)]
    dist.all_gather(every, mine, group=groups.tp_group)
    shapes = [(int(t[0]), int(t[1])) for t in every]
    bad = [groups.tp_ranks()[i] for i, (rows, _) in enumerate(shapes) if rows < 0]
    if bad:
        raise ValueError(f"score_at_layout: bad tokens / labels on rank(s) {bad} of the teacher's tensor-parallel "
                         f"group {groups.tp_ranks()}" + (f": {problem}" if problem else ""))
    return shapes


def _gathered(groups: TeacherGroups, value: torch.Tensor, shapes: list[tuple[int, int]]) -> torch.Tensor:
    """The group's [rows_i, length_i] tensors padded on the right to the longest and concatenated."""
    rows, length = max(r for r, _ in shapes), max(s for _, s in shapes)
    mine = torch.zeros(rows, length, dtype=torch.int64)
    mine[: value.shape[0], : value.shape[1]] = value
    every = [torch.empty_like(mine) for _ in shapes]
    dist.all_gather(every, mine, group=groups.tp_group)
    return torch.cat([part[:r] for part, (r, _) in zip(every, shapes)])


def _causal_mask(length: int) -> torch.Tensor:
    """megatron-core's attention mask (True: masked out) of a causal [1, 1, s, s] attention."""
    return torch.ones(length, length, dtype=torch.bool).triu(1)[None, None]


def score_at_layout(
    chunks: Any,
    tokens: torch.Tensor,
    labels: torch.Tensor,
    *,
    layout: TeacherLayout | None = None,
    temperature: float = 1.0,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """The teacher's log p(labels[i, t] | tokens[i, :t+1]) for this rank's rows, [rows, length] fp32.

    `chunks`: what build_inference_model_from_hf(path, layout=TeacherLayout(tp=N)) returned;
    `tokens` / `labels`: this rank's student micro-batch (Megatron's convention: labels[t] is the
    token after tokens[t]); rows and lengths may differ between ranks, a rank may have no rows.
    A collective over the teacher's tensor-parallel group: every rank of the default group calls
    it once per micro-batch. `layout`: checked against the chunks' own when given; `vocab_size`:
    the real vocab (default: the checkpoint's, so padded vocab rows get no mass); `temperature`
    divides the logits."""
    from megatron_rl_patches.ops import log_probs_and_entropy

    model, groups = _groups_of(chunks, layout)
    shapes = _agree(groups, tokens, labels)
    first = sum(rows for rows, _ in shapes[: groups.tp_rank])
    rows, length = shapes[groups.tp_rank]
    all_tokens = _gathered(groups, tokens, shapes)
    all_labels = _gathered(groups, labels, shapes)
    total, longest = all_tokens.shape
    if total == 0 or longest == 0:
        return torch.zeros(rows, length, dtype=torch.float32)
    device = next(model.parameters()).device
    position_ids = torch.arange(longest).expand(total, longest)
    with torch.no_grad():
        mask = _causal_mask(longest).expand(total, 1, longest, longest)
        logits = model(all_tokens.to(device), position_ids.to(device), mask.to(device))  # [b, s, V / tp]
        log_probs, _ = log_probs_and_entropy(
            logits.reshape(total * longest, -1), all_labels.to(device).reshape(-1), tp_group=groups.tp_group,
            temperature=temperature,
            vocab_size=vocab_size if vocab_size is not None else getattr(model, "hf_vocab_size", None))
    return log_probs.view(total, longest)[first: first + rows, :length].float()
