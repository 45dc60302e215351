"""slime's side of top-k OPD's teachers with another tokenizer (`integrations.megatron.opd
.cross_passes`): slime's `--use-opd` checks, the per-sample fields the student's step reads cut to
slime's context-parallel rows (`place`, `spread_for_slime`, cut by slime's `cp_utils`: `cut`) and
the student's token log-probs they are read against (`token_log_probs`); their terms in the loss
are `integrations.megatron.opd.opd_terms`'."""
# lazy imports: optional dependency slime
from __future__ import annotations

from typing import Any

import torch

from megatron_rl_patches.integrations.megatron.opd import step_repeats
from megatron_rl_patches.integrations.megatron.opd.opd_settings import TEACHERS, OpdSettings
from megatron_rl_patches.integrations.megatron.opd.topk_request import (
    CROSS_ALIVE,
    CROSS_LOGPROBS,
    CROSS_RATIO,
    CROSS_TAILS,
    CROSS_TEACHERS,
    IDS,
    IDS_MASK,
    STEP_IDS,
    STEP_MASK,
    STEP_SAME_AS,
)
from megatron_rl_patches.integrations.megatron.opd.zigzag import zigzag_from_local
from megatron_rl_patches.integrations.slime.allgather_cp import allgather_cp_active
from megatron_rl_patches.integrations.slime.topk import per_sample_rows
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


def place(rollout_data: dict, scored: list[TeacherScores], same: bool, union: bool,
          indices: list[int]) -> None:
    """The cross teachers' fields in the rollout data, cut to this rank's rows: per sample the
    step's ids (the same-tokenizer ids when `same`, then each teacher's bucket ids), the stacked
    per-teacher values, and which teachers (`indices`: their places in the settings) gave them."""
    n = len(rollout_data["tokens"])
    parts: list[list[torch.Tensor]] = [[] for _ in range(n)]
    masks: list[list[torch.Tensor]] = [[] for _ in range(n)]
    if same:
        for i, ids in enumerate(rollout_data[IDS]):
            parts[i].append(ids)
            masks[i].append(rollout_data[IDS_MASK][i] if union else torch.ones_like(ids, dtype=torch.bool))
    depth = max(_first(out.ids).shape[-1] // _first(out.alive).shape[-1] for out in scored)
    for out in scored:
        pairs = zip(cut(_each(out.ids), rollout_data), cut(_each(out.ids_mask), rollout_data), _each(out.alive))
        for i, (ids, mask, alive) in enumerate(pairs):
            device = rollout_data[IDS][i].device
            parts[i].append(_deepened(ids, alive.shape[-1], depth).to(device))
            masks[i].append(_deepened(mask, alive.shape[-1], depth).to(device))
    rollout_data[STEP_IDS] = [torch.cat(p, dim=1) for p in parts]
    once = [step_repeats.unrepeated(ids, torch.cat(m, dim=1)) for ids, m in zip(rollout_data[STEP_IDS], masks)]
    rollout_data[STEP_MASK] = [mask for mask, _ in once]
    rollout_data[STEP_SAME_AS] = [same_as for _, same_as in once]
    for key, field in ((CROSS_RATIO, "log_ratio"), (CROSS_LOGPROBS, "log_probs"), (CROSS_TAILS, "tails"),
                       (CROSS_ALIVE, "alive")):
        per_teacher = [cut(_each(getattr(out, field)), rollout_data) for out in scored]
        rollout_data[key] = [torch.stack(values, dim=1) for values in zip(*per_teacher)]
    rollout_data[CROSS_TEACHERS] = [torch.tensor(indices, dtype=torch.int64) for _ in range(n)]  # read by opd_terms


def _each(values: list[torch.Tensor] | None) -> list[torch.Tensor]:
    """A grouped-bucket field of `TeacherScores` (set by every teacher `place` receives)."""
    assert values is not None, "a teacher with grouped buckets gives ids, their mask, alive and log_ratio"
    return values


def _first(values: list[torch.Tensor] | None) -> torch.Tensor:
    return _each(values)[0]


def _deepened(values: torch.Tensor, k: int, depth: int) -> torch.Tensor:
    """[R, k·D] bucket slots as [R, k·depth] (each bucket padded with zeros / False to `depth` slots)."""
    rows = values.reshape(values.shape[0], k, -1)
    pad = rows.new_zeros((rows.shape[0], k, depth - rows.shape[-1]))
    return torch.cat([rows, pad], dim=-1).reshape(values.shape[0], -1)


def spread_for_slime(rollout_data: dict, scored: TeacherScores, student_log_probs: list[torch.Tensor]) -> None:
    """slime's `--use-opd` field: teacher_log_probs = the spread teacher signal (log pS + log-ratio),
    cut to this rank's rows as slime cuts it."""
    spread = [lp.float() + ratio.to(lp.device) for lp, ratio in zip(student_log_probs, _each(scored.log_ratio))]
    rollout_data["teacher_log_probs"] = cut(spread, rollout_data)


def token_log_probs(args: Any, batch: dict, output: Any) -> torch.Tensor:
    """The student's log p(y_i) [N] of the micro-batch's response tokens with their gradient, in
    the rows slime's per-sample fields use (zigzag with --allgather-cp)."""
    if not isinstance(output, dict):
        raise RuntimeError("slime_opd: a teacher with another tokenizer needs the fused route's output; the step "
                           "fell back to slime's logits path (the slime_fused log line names why)")
    allgather = allgather_cp_active(args)
    values = output["log_probs"]
    pieces = per_sample_rows(values, batch, allgather)
    if allgather:
        # differentiable: the pieces require grad
        pieces = zigzag_from_local(pieces, values.shape[1], batch["total_lengths"], batch["response_lengths"])
    return torch.cat(pieces)
