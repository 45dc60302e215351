"""The per-token OPD terms of every teacher of a step (`loss_terms`; `mixture_terms` when every
teacher has the student's tokenizer), from the micro-batch's
per-sample fields (the keys of `topk_request`, which a host fills from the teachers' scores): the
same-tokenizer teachers as one mixture over the student's top-k ids with their exact tails, each
teacher with another tokenizer as its chunk-start bucket divergence plus its token-level
reverse-KL term (`cross_tokenizer.chunk_terms`; docs/distillation.md, "Teachers with another
tokenizer"). Framework-free given the fields: slime's loss (`integrations/slime/opd.py`) calls it."""
from __future__ import annotations

import torch

from megatron_rl_patches.cross_tokenizer.chunk_terms import chunk_distillation_terms, masked_tail
from megatron_rl_patches.integrations.megatron.opd import step_repeats
from megatron_rl_patches.integrations.megatron.opd import topk_request as fields
from megatron_rl_patches.integrations.megatron.opd.opd_settings import OpdSettings
from megatron_rl_patches.ops.topk import topk_kl


def loss_terms(settings: OpdSettings, batch: dict, student: torch.Tensor, student_tail: torch.Tensor,
               token_log_probs: torch.Tensor, invariant: bool | None = None) -> torch.Tensor:
    """Per response token [N] of the micro-batch: the weighted OPD terms of every teacher, the
    same-tokenizer ones as one mixture over the student's top-k ids, each other-tokenizer one as its
    chunk-start bucket divergence plus its token-level reverse-KL term (gradient r·∇log pS);
    `invariant`: the divergences' mode (the student's)."""
    n = len(settings.teachers)
    weights = settings.weights or tuple(1.0 / n for _ in range(n))
    # which teachers gave grouped buckets: their scores say so (`place`), not the settings
    cross = [int(i) for i in batch[fields.CROSS_TEACHERS][0].tolist()]
    same = [i for i in range(n) if i not in cross]
    mask = torch.cat(batch[fields.STEP_MASK]).to(device=student.device, dtype=torch.bool)
    if batch.get(fields.STEP_SAME_AS) is not None:  # an id repeated across the parts: scored once, read by each
        student, mask = step_repeats.restored(student, mask, torch.cat(batch[fields.STEP_SAME_AS]))
    parts = len(cross) + bool(same)
    total = torch.zeros_like(token_log_probs)
    start = 0
    if same:
        width = batch[fields.IDS][0].shape[-1]
        cols, part_mask = student[:, :width], mask[:, :width]
        tail = student_tail if parts == 1 else masked_tail(cols, part_mask)
        group = torch.tensor([weights[i] for i in same], dtype=torch.float64)
        teachers = torch.cat(batch[fields.TEACHER_LOGPROBS], dim=1).to(cols)
        tails = torch.cat(batch[fields.TEACHER_TAILS], dim=1).to(cols)
        total = total + float(group.sum()) * topk_kl(cols, tail, teachers, tails, teacher_weights=group / group.sum(),
                                                     divergence=settings.divergence, ids_mask=part_mask,
                                                     invariant=invariant)
        start = width
    ratio = torch.cat(batch[fields.CROSS_RATIO]).to(token_log_probs)
    scores = torch.cat(batch[fields.CROSS_LOGPROBS]).to(student)
    tails = torch.cat(batch[fields.CROSS_TAILS]).to(student)
    alive = torch.cat(batch[fields.CROSS_ALIVE]).to(device=student.device, dtype=torch.bool)
    width = (mask.shape[1] - start) // max(len(cross), 1)  # `place` gives every such teacher one width
    for x, index in enumerate(cross):
        cols, part_mask = student[:, start:start + width], mask[:, start:start + width]
        start += width
        tail = student_tail if parts == 1 else masked_tail(cols, part_mask)
        total = total + weights[index] * chunk_distillation_terms(cols, part_mask, tail, scores[:, x], tails[:, x],
                                                                  alive[:, x], ratio[:, x], token_log_probs,
                                                                  settings.divergence, invariant)
    return total


def mixture_terms(settings: OpdSettings, batch: dict, student: torch.Tensor, student_tail: torch.Tensor,
                  invariant: bool | None = None) -> torch.Tensor:
    """Per response token [N] of the micro-batch: the divergence between the student's buckets over
    the step's ids and the mixture of the teachers (all of the student's tokenizer: their
    `TEACHER_LOGPROBS` / `TEACHER_TAILS`, a union's padded slots masked by `IDS_MASK`)."""
    teachers = torch.cat(batch[fields.TEACHER_LOGPROBS], dim=1).to(student)
    tails = torch.cat(batch[fields.TEACHER_TAILS], dim=1).to(student)
    weights = None if settings.weights is None else torch.tensor(settings.weights, dtype=torch.float64)
    mask = batch.get(fields.IDS_MASK)
    mask = None if mask is None else torch.cat(mask).to(device=student.device, dtype=torch.bool)
    return topk_kl(student, student_tail, teachers, tails, teacher_weights=weights, divergence=settings.divergence,
                   ids_mask=mask, invariant=invariant)
