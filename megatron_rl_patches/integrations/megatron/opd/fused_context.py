"""What top-k OPD's fused model call places on a micro-batch's packed rows, for any pipelined
Megatron host that keeps per-sample fields in its response rows (zigzag ones where its passes run on
contiguous slices: slime's `--allgather-cp`, `allgather_cp`): the request's per-sample ids (and
their padding mask) for the top-k processor (`topk_context`; the processor is
`processors.combined.with_topk`), and full-vocabulary OPD's processor (MEGATRON_RL_PATCHES_OPD_K=vocab,
`vocab_processor`): a teacher's pass returning its final hidden states and keeping its output
weight's shard (`processors.combined.hidden_pass_processor`), or the training step's log-probs plus
the per-token divergence between the student and the teachers' mixture over the whole vocabulary
(`lm_head_divergence` through `divergence_output_processor`, tile by tile: no [T, V] tensor) on the
response rows only, the teachers' per-sample hidden states placed on the packed rows. On a host's
logits path the student's buckets come from its logits (`logits_buckets`). The host
supplies `positions`, asked where a context needs them: per sample, the local packed rows its slicing
reads for the response."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from megatron_rl_patches.integrations.megatron.opd.hidden_teachers import TeacherHeads
from megatron_rl_patches.integrations.megatron.opd.topk_request import (
    IDS,
    IDS_MASK,
    TEACHER_HEADS,
    TEACHER_HIDDEN,
    VocabRequest,
)
from megatron_rl_patches.integrations.megatron.opd.zigzag import local_from_zigzag, local_rows
from megatron_rl_patches.ops.packing import packed_ids, packed_topk_logprobs, positions_mask
from megatron_rl_patches.processors.combined import hidden_pass_processor, with_divergence
from megatron_rl_patches.processors.distill import divergence_output_processor

DIVERGENCE = "opd_divergence"  # the fused output's key: the per-token divergence [1, T]
Positions = Callable[[], list[torch.Tensor]]  # the host's per-sample local response rows, when asked
NOT_SCORED = ("slime_opd: the training step under MEGATRON_RL_PATCHES_OPD_K=vocab found no teacher hidden states in "
              "its batch; the teachers' passes did not run before it (apply the slime_opd patch with slime_fused)")


def topk_context(request: Any, batch: dict, positions: Positions, length: int, allgather_cp: bool) -> dict:
    """The top-k processor's context for a micro-batch: {"ids": [1, T, k]} (and "ids_mask" when the
    request names one) when the request reads the batch's ids, else {} (the processor selects its own)."""
    if request.ids_key is None:
        return {}
    per_sample = batch.get(request.ids_key)
    if per_sample is None:
        raise RuntimeError(f"slime_opd: the micro-batch has no {request.ids_key!r}; the actor's top-k pass did not "
                           "run before this step (apply the slime_opd patch with slime_fused)")
    masks = None if request.mask_key is None else batch[request.mask_key]
    if allgather_cp:
        per_sample, masks = local_rows(batch, length, per_sample, masks)
    rows = positions()
    context = {"ids": packed_ids(per_sample, rows, length)[None]}
    if masks is not None:
        context["ids_mask"] = packed_ids(masks, rows, length, dtype=torch.bool)[None]
    return context


def vocab_processor(request: VocabRequest, log_prob: Callable, options: dict, batch: dict,
                    positions: Positions, length: int, device: Any, allgather_cp: bool) -> Callable:
    """The fused call's processor for `request`: a teacher's hidden-state pass, or the training
    step's log-probs (`log_prob`, the host's) plus the per-token divergence under `DIVERGENCE`
    ([1, T], 0 outside the response rows)."""
    if request.hidden:
        return hidden_pass_processor(request.captured)
    heads, teacher_rows = teacher_context(batch, positions, length, allgather_cp)
    rows = positions()
    sizes = [size for size in (options.get("vocab_size"), heads.vocab_size) if size is not None]
    divergence = divergence_output_processor(divergence=request.divergence, teacher_weights=request.weights,
                                             temperature=options["temperature"], chunk_size=options.get("chunk_size"),
                                             vocab_size=min(sizes) if sizes else None)
    vocab_context = {"teacher_hidden": teacher_rows, "teacher_weight": list(heads.weights),
                     "row_mask": positions_mask(rows, length, device)[None]}
    return with_divergence(log_prob, divergence, DIVERGENCE, vocab_context)


def teacher_context(batch: dict, positions: Positions, length: int,
                    allgather_cp: bool) -> tuple[TeacherHeads, list[torch.Tensor]]:
    """The micro-batch's teachers: their heads and, per teacher, its hidden states [1, T, H_j] on
    the packed rows (zeros outside the responses; never read: the row mask keeps them out)."""
    per_sample, heads = batch.get(TEACHER_HIDDEN), batch.get(TEACHER_HEADS)
    if per_sample is None or heads is None:
        raise RuntimeError(NOT_SCORED)
    where, rows = positions(), []
    for teacher in zip(*per_sample):  # one teacher's per-sample [R, H_j]
        states = list(teacher)
        if allgather_cp:  # the host keeps them in the zigzag rows; the pass runs on contiguous ones
            states = local_from_zigzag(states, length, batch["total_lengths"], batch["response_lengths"])
        rows.append(packed_ids(states, where, length, dtype=states[0].dtype)[None])
    return heads[0], rows


def logits_buckets(rows: torch.Tensor, batch: dict, positions: list[torch.Tensor], allgather_cp: bool,
                   temperature: float, invariant: bool | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The student's [1, N, k] log-probs at the batch's ids (`IDS`; padded slots of a union -inf)
    and [1, N] tails on its response rows (`positions`), from the packed logits `rows` [T, V/tp] by
    the top-k op over the tensor-parallel group, in the step's `invariant` mode."""
    from megatron.core import parallel_state  # lazy: optional dependency megatron-core

    group = parallel_state.get_tensor_model_parallel_group()
    group = group if torch.distributed.get_world_size(group) > 1 else None
    ids, mask = batch[IDS], batch.get(IDS_MASK)
    if allgather_cp:
        ids, mask = local_rows(batch, rows.shape[0], ids, mask)
    logp, tail = packed_topk_logprobs(rows, ids, mask, positions, tp_group=group, temperature=temperature,
                                      invariant=invariant)
    return logp[None], tail[None]
