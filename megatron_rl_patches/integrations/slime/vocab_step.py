"""Full-vocabulary OPD's fused calls in slime (MEGATRON_RL_PATCHES_OPD_K=vocab, `vocab_opd`): a
teacher's pass returning its final hidden states and keeping its output weight's shard
(`processors.combined.hidden_pass_processor`), and the training step's processor: slime's
log-probs plus the per-token divergence between the student and the teachers' mixture over the
whole vocabulary
(`lm_head_divergence` through `divergence_output_processor`, tile by tile: no [T, V] tensor), on the
response rows only, the teachers' per-sample hidden states placed on the micro-batch's packed rows
(the contiguous rows under --allgather-cp)."""
# lazy imports: optional dependency megatron-core
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from megatron_rl_patches.integrations.megatron.opd.hidden_teachers import TeacherHeads
from megatron_rl_patches.integrations.megatron.opd.topk_request import TEACHER_HEADS, TEACHER_HIDDEN, VocabRequest
from megatron_rl_patches.integrations.megatron.opd.zigzag import local_from_zigzag
from megatron_rl_patches.integrations.slime.rows import response_positions, response_rows
from megatron_rl_patches.ops.packing import packed_ids
from megatron_rl_patches.processors.combined import hidden_pass_processor, with_divergence
from megatron_rl_patches.processors.distill import divergence_output_processor

DIVERGENCE = "opd_divergence"  # the fused output's key: the per-token divergence [1, T]
NOT_SCORED = ("slime_opd: the training step under MEGATRON_RL_PATCHES_OPD_K=vocab found no teacher hidden states in "
              "its batch; the teachers' passes did not run before it (apply the slime_opd patch with slime_fused)")


def vocab_processor(request: VocabRequest, log_prob: Callable, options: dict, batch: dict, length: int, device: Any,
                    allgather_cp: bool) -> Callable:
    """The fused call's processor for `request`: a teacher's hidden-state pass, or the training
    step's log-probs (slime's) plus the per-token divergence under `DIVERGENCE` ([1, T], 0 outside
    the response rows)."""
    if request.hidden:
        return hidden_pass_processor(request.captured)
    heads, teacher_rows = teacher_context(batch, length, device, allgather_cp)
    sizes = [size for size in (options.get("vocab_size"), heads.vocab_size) if size is not None]
    divergence = divergence_output_processor(divergence=request.divergence, teacher_weights=request.weights,
                                             temperature=options["temperature"], chunk_size=options.get("chunk_size"),
                                             vocab_size=min(sizes) if sizes else None)
    vocab_context = {"teacher_hidden": teacher_rows, "teacher_weight": list(heads.weights),
                     "row_mask": response_rows(batch, length, device, allgather_cp)[None]}
    return with_divergence(log_prob, divergence, DIVERGENCE, vocab_context)


def teacher_context(batch: dict, length: int, device: Any,
                    allgather_cp: bool) -> tuple[TeacherHeads, list[torch.Tensor]]:
    """The micro-batch's teachers: their heads and, per teacher, its hidden states [1, T, H_j] on
    the packed rows (zeros outside the responses; never read: the row mask keeps them out)."""
    per_sample, heads = batch.get(TEACHER_HIDDEN), batch.get(TEACHER_HEADS)
    if per_sample is None or heads is None:
        raise RuntimeError(NOT_SCORED)
    positions = response_positions(batch, length, device, allgather_cp)
    rows = []
    for teacher in zip(*per_sample):  # one teacher's per-sample [R, H_j]
        states = list(teacher)
        if allgather_cp:  # slime keeps them in the zigzag rows; the pass runs on contiguous ones
            states = local_from_zigzag(states, length, batch["total_lengths"], batch["response_lengths"])
        rows.append(packed_ids(states, positions, length, dtype=states[0].dtype)[None])
    return heads[0], rows
