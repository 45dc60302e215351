"""slime's side of top-k OPD's teachers with another tokenizer (`integrations.megatron.opd
.cross_passes`): slime's `--use-opd` checks and field (`spread_for_slime`), whole-response values
cut to slime's context-parallel rows by slime's `cp_utils` (`cut`, the step's `cut_rows`: the
fields `topk_teachers.place` stores) and the student's token log-probs they are read against
(`token_log_probs`); their terms in the loss are `integrations.megatron.opd.opd_terms`'."""
# lazy imports: optional dependency slime
from __future__ import annotations

from typing import Any

import torch

from megatron_rl_patches.integrations.megatron.opd.opd_settings import TEACHERS, OpdSettings
from megatron_rl_patches.integrations.megatron.opd.topk_teachers import grouped_field
from megatron_rl_patches.integrations.slime.topk import allgather_cp_active, sample_rows
from megatron_rl_patches.teachers.scores import TeacherScores


def check_args(args: Any, settings: OpdSettings) -> None:
    """Before anything loads: slime's `--use-opd` with teachers of another tokenizer (one such
    teacher, whose spread signal are its teacher_log_probs; slime's sglang mode: its megatron mode
    overwrites teacher_log_probs with its own teacher's). Every layout is served (expert parallelism:
    the teacher's micro-batches agreed over the data-parallel ranks, `expert_agreement`)."""
    if not any(t.other_tokenizer for t in settings.teachers):
        return
    if not getattr(args, "use_opd", False):
        return
    own = sum(t.other_tokenizer for t in settings.teachers)
    if own != 1:
        raise ValueError(f"{TEACHERS}: slime's --use-opd takes one teacher's log-probs; name one teacher with "
                         f"';tokenizer=own' (got {own}), or use top-k OPD's loss for several")
    if getattr(args, "opd_type", None) != "sglang":
        raise ValueError(f"{TEACHERS} with ';tokenizer=own' fills slime's teacher_log_probs: run --use-opd with "
                         f"--opd-type sglang (--opd-type {getattr(args, 'opd_type', None)} loads its own teacher "
                         "over them)")


def cut(values: list[torch.Tensor], data: dict) -> list[torch.Tensor]:
    """Whole-response values as slime keeps per-sample fields on this context-parallel rank."""
    from slime.backends.megatron_utils.cp_utils import slice_log_prob_with_cp  # slime is not a dependency

    return [slice_log_prob_with_cp(v, total, response) for v, total, response in
            zip(values, data["total_lengths"], data["response_lengths"])]


def spread_for_slime(rollout_data: dict, scored: TeacherScores, student_log_probs: list[torch.Tensor]) -> None:
    """slime's `--use-opd` field: teacher_log_probs = the spread teacher signal (log pS + log-ratio),
    cut to this rank's rows as slime cuts it."""
    spread = [lp.float() + ratio.to(lp.device) for lp, ratio in zip(student_log_probs, grouped_field(scored.log_ratio))]
    rollout_data["teacher_log_probs"] = cut(spread, rollout_data)


def token_log_probs(args: Any, batch: dict, output: Any) -> torch.Tensor:
    """The student's log p(y_i) [N] of the micro-batch's response tokens with their gradient, in
    the rows slime's per-sample fields use (zigzag with --allgather-cp)."""
    if not isinstance(output, dict):
        raise RuntimeError("slime_opd: a teacher with another tokenizer needs the fused route's output; the step "
                           "fell back to slime's logits path (the slime_fused log line names why)")
    return torch.cat(sample_rows(output["log_probs"], batch, allgather_cp_active(args)))  # with its gradient
