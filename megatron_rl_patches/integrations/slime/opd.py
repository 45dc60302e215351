"""`slime_opd`: top-k multi-teacher on-policy distillation inside slime's own actor (624b824a),
switched on by MEGATRON_RL_PATCHES_OPD_TEACHERS (`opd_settings`) with slime's custom loss:

    --loss-type custom_loss --custom-loss-function-path \
        megatron_rl_patches.integrations.slime_opd.topk_opd_policy_loss

Teachers load after the actor's `init` (`teacher_builders.load_teachers`: same-architecture ones as
snapshots in slime's TensorBackuper, one restore per teacher per step; others as inference-only
models). Before `train_actor` they score the rollout (`topk_teachers.score_step`: [R, k] per sample
and teacher at the actor's top-k ids or those MEGATRON_RL_PATCHES_OPD_IDS_FROM names; nothing [T, V]).
slime supplies its actor (`actor.SlimeActor`), its `forward_only` pass (`topk_pass`) and its cut."""
# lazy imports: optional dependency slime
from __future__ import annotations

import functools
from typing import Any

import torch

from megatron_rl_patches.integrations.megatron.opd import (
    opd_terms,
    teacher_builders,
    topk_teachers,
)
from megatron_rl_patches.integrations.megatron.opd.carried_rows import CARRIED, take_rows
from megatron_rl_patches.integrations.megatron.opd.fused_context import logits_buckets
from megatron_rl_patches.integrations.megatron.opd.opd_settings import (
    LOSS_PATH,
    LOSS_PATHS,
    TEACHERS,
    OpdSettings,
)
from megatron_rl_patches.integrations.megatron.opd.opd_teachers import (
    OpdTeacher,
    ScoringStep,
    TeacherScores,
    opd_teacher,
)
from megatron_rl_patches.integrations.megatron.opd.served_checks import check_served
from megatron_rl_patches.integrations.megatron.opd.served_opd import note_figures
from megatron_rl_patches.integrations.megatron.opd.stage_host import pipeline_agrees
from megatron_rl_patches.integrations.megatron.opd.step_contexts import step_contexts
from megatron_rl_patches.integrations.megatron.opd.topk_request import (
    CONTEXTS,
    CROSS_RATIO,
    FIGURES,
    NOT_METRICS,
    TEACHER_LOGPROBS,
    TopkRequest,
)
from megatron_rl_patches.integrations.megatron.opd.topk_request import IDS as IDS
from megatron_rl_patches.integrations.megatron.opd.topk_request import IDS_MASK as IDS_MASK
from megatron_rl_patches.integrations.megatron.opd.topk_request import TEACHER_TAILS as TEACHER_TAILS
from megatron_rl_patches.integrations.megatron.shared_prefix_pass import logged
from megatron_rl_patches.integrations.megatron.step_iterators import carrying
from megatron_rl_patches.integrations.slime import cross_loss, vocab_opd
from megatron_rl_patches.integrations.slime.actor import SlimeActor
from megatron_rl_patches.integrations.slime.contexts import check_layouts
from megatron_rl_patches.integrations.slime.fused import unservable
from megatron_rl_patches.integrations.slime.fused_step import (
    FusedStep,
    fused_step_in,
    slime_prefix_pass,
    slime_settings,
)
from megatron_rl_patches.integrations.slime.rows import response_positions
from megatron_rl_patches.integrations.slime.topk import allgather_cp_active, sample_rows
from megatron_rl_patches.integrations.step_mode import student_invariant
from megatron_rl_patches.model.arguments import argument, bind
from megatron_rl_patches.model.chunks import unwrap
from megatron_rl_patches.ops.topk import topk_kl as topk_kl
from megatron_rl_patches.teachers.kinds import RunFacts, check_entries

# IDS, IDS_MASK, TEACHER_TAILS, topk_kl: imported `as` themselves, re-exported for the tests reading them here
ATTRIBUTE = "_megatron_rl_patches_opd_teachers"


def check_args(args: Any, settings: OpdSettings | None = None) -> None:
    """slime's flags top-k OPD needs, checked before the first step (slime's own `--use-opd` with a
    teacher of another tokenizer needs no custom loss: its advantages read the spread signal)."""
    custom = getattr(args, "loss_type", None) == "custom_loss"
    advantages_only = settings is not None and getattr(args, "use_opd", False) and \
        any(t.other_tokenizer for t in settings.teachers)
    if settings is not None:
        check_entries(settings.teachers, RunFacts(temperature=getattr(args, "rollout_temperature", None),
                                                  ids_from=settings.ids_from, k=settings.k,
                                                  temperature_from="slime's --rollout-temperature"))
        check_served(settings)
        check_layouts(args, settings)
        cross_loss.check_args(args, settings)
    if not advantages_only and (not custom or getattr(args, "custom_loss_function_path", None) not in LOSS_PATHS):
        raise ValueError(f"{TEACHERS} is set: top-k OPD needs slime's flags --loss-type custom_loss "
                         f"--custom-loss-function-path {LOSS_PATH} (got --loss-type {args.loss_type}); "
                         f"or unset {TEACHERS}")
    reason = unservable(args)
    if reason is not None:
        raise ValueError(f"{TEACHERS} is set with {reason}: slime_fused sends that to slime's logits path, and "
                         "top-k OPD's teacher passes need the fused route on the last pipeline stage (a fallback "
                         "there alone would leave the other stages waiting); drop that flag or unset it")


def load_teachers(actor: Any, settings: OpdSettings) -> list[OpdTeacher]:
    """Each teacher as an `OpdTeacher` for slime's actor, its flags checked first
    (`teacher_builders.load_teachers`: a snapshot of the actor, or a separate model)."""
    check_args(actor.args, settings)
    return teacher_builders.load_teachers(SlimeActor(actor), settings)


def init_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper for the actor's `init`: top-k OPD's teachers loaded after slime's own."""
    result = wrapped(*args, **kwargs)
    settings = slime_settings(getattr(instance, "args", None))
    if settings is not None and getattr(instance, "role", "actor") == "actor" and hasattr(instance, "model"):
        setattr(instance, ATTRIBUTE, load_teachers(instance, settings))
    return result


FELL_BACK = ("slime_opd: a top-k pass fell back to slime's logits path (the slime_fused log line names why); "
             "top-k OPD scores the student's ids and the teachers on the fused route only: remove that feature "
             "from the configuration or unset MEGATRON_RL_PATCHES_OPD_TEACHERS")


def collect_topk(output: Any, *, total_lengths: list[int], response_lengths: list[int], args: Any = None,
                 fell_back: list | None = None, **_: Any) -> tuple:
    """slime's forward_only callback for a top-k pass: the buckets per sample (detached; with
    --allgather-cp in slime's zigzag rows, as slime keeps every per-sample field). Logits (a
    fallback) are noted in `fell_back` for the pass to agree on; without it, an error here. A
    full-vocabulary teacher's pass (`vocab_opd`) gives its hidden states the same way."""
    if not isinstance(output, dict):
        if fell_back is None:
            raise RuntimeError(FELL_BACK)
        fell_back.append(True)
        return torch.empty((0,), device=output.device), {}
    batch = {"total_lengths": total_lengths, "response_lengths": response_lengths}
    allgather = allgather_cp_active(args)
    result = {}
    for key in ("topk_ids", "ids_mask", "topk_log_probs", "tail", "log_probs", "teacher_hidden"):
        if key in output:
            result[key] = sample_rows(output[key].detach(), batch, allgather)
    return torch.empty((0,), device=output["log_probs"].device), result


def pipelined_topk(args: Any, model: list[Any], rollout_data: dict, request: TopkRequest,
                   fell_back: list, invariant: bool | None = None) -> dict[str, list[torch.Tensor]]:
    """slime's `forward_only` over the rollout with the fused route's top-k request in the step's
    `invariant` mode, carried by its data iterators (a fallback on this rank noted in `fell_back`)."""
    # slime is not a dependency: this module imports without it (its tests, the settings checks)
    from slime.backends.megatron_utils import model as slime_model
    from slime.backends.megatron_utils.data import get_data_iterator

    iterators = get_data_iterator(rollout_data)
    step = FusedStep(args, with_entropy=False, entropy_requires_grad=False, topk=request, invariant=invariant,
                     prefix=slime_prefix_pass(args, model, "a teacher's pass", training=False, iterators=iterators,
                                              counts=rollout_data["num_microbatches"], first=0))
    iterator = carrying(iterators, step)
    collect = functools.partial(collect_topk, fell_back=fell_back)
    with logged(step.prefix):
        return slime_model.forward_only(collect, args, model, iterator, rollout_data["num_microbatches"])


def topk_pass(args: Any, model: list[Any], rollout_data: dict, request: TopkRequest,
              invariant: bool | None = None) -> dict[str, list[torch.Tensor]]:
    """One top-k pass in the step's `invariant` mode; a fallback (seen on the last stage only) is
    agreed by every pipeline stage before any of them raises, so none waits in the next pass for
    a stage that left."""
    fell_back: list = []
    out = pipelined_topk(args, model, rollout_data, request, fell_back, invariant)
    if not pipeline_agrees(not fell_back):
        raise RuntimeError(FELL_BACK)
    return out


def score_teachers(actor: Any, rollout_data: dict, settings: OpdSettings) -> None:
    """The step's teachers on slime's actor (`topk_teachers.score_step`: the actor's top-k ids
    first, then each teacher's scores, or the full vocabulary's hidden states), every pass in the
    student's invariant mode, resolved once here from its model; on the last stage the scores stored
    (`store_scores`)."""
    if actor._active_model_tag != "actor":
        actor._switch_model("actor")
    invariant = student_invariant(actor.model)  # the teachers' passes follow the student's mode
    teachers = [opd_teacher(teacher) for teacher in getattr(actor, ATTRIBUTE)]
    scored = topk_teachers.score_step(SlimeActor(actor), rollout_data, settings, teachers,
                                      functools.partial(topk_pass, invariant=invariant), invariant, cross_loss.cut)
    if scored is not None:
        store_scores(*scored)


def store_scores(step: ScoringStep, scores: list[TeacherScores]) -> None:
    """The teachers' scores in the rollout data (`topk_teachers.store_scores`: stacked over the
    step's ids, grouped buckets placed), and slime's `--use-opd` field from the first teacher of
    grouped buckets (another tokenizer)."""
    topk_teachers.store_scores(step, scores)
    grouped = [out for out in scores if out.ids is not None]
    if grouped and getattr(step.actor.args, "use_opd", False):
        cross_loss.spread_for_slime(step.rollout_data, grouped[0], step.student_log_probs)


def train_actor_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper for the actor's `train_actor(rollout_id, rollout_data)`: teachers scored first
    (the settings as the actor's `args` hold them, `slime_settings`; its training steps read the same)."""
    rollout_data = argument("rollout_data", 1, args, kwargs)
    if isinstance(rollout_data, dict) and hasattr(instance, ATTRIBUTE):
        settings = slime_settings(instance.args)
        if settings is not None:
            vocab = int(unwrap(instance.model[-1]).vocab_size)
            take_rows(rollout_data)  # the rows a rollout's served teachers gave, off the carried contexts
            contexts = step_contexts(instance.args, rollout_data, settings, vocab)  # agreed before any teacher is asked
            if contexts is not None:
                rollout_data[CONTEXTS] = contexts
            score_teachers(instance, rollout_data, settings)
            note_figures([opd_teacher(t) for t in getattr(instance, ATTRIBUTE)], rollout_data)  # teacher/... keys
    return wrapped(*args, **kwargs)


def log_rollout_data_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper for slime's `log_rollout_data(rollout_id, args, rollout_data)`: slime averages
    every tensor list outside its ignore sets, and top-k OPD's fields are no metric (int64 ids and a
    bool mask have no mean; [n, R, k] scores do not concatenate across samples): slime logs the
    rollout data without them, and without the samples' privileged contexts (`contexts`: per-sample
    dicts, which slime would sum). The training steps still read them (the dict itself is unchanged)."""
    bound = bind(wrapped, args, kwargs)
    data = None if bound is None else bound.arguments.get("rollout_data")
    keys = (*NOT_METRICS, CARRIED)
    if bound is None or not isinstance(data, dict) or not any(key in data for key in keys):
        return wrapped(*args, **kwargs)
    bound.arguments["rollout_data"] = {key: value for key, value in data.items() if key not in keys}
    result = wrapped(*bound.args, **bound.kwargs)
    log_figures(bound.arguments.get("rollout_id"), bound.arguments.get("args"), data.get(FIGURES))  # teacher/...
    return result


def log_figures(rollout_id: Any, args: Any, figures: dict[str, float] | None) -> None:
    """The train step's served teachers' figures (`served_opd.note_figures`, on the last stage:
    `TeacherStep.metrics()` summed, fixed keys `step_metrics.fixed_figures`) through slime's
    `gather_log_data("teacher", ...)` as `teacher/...`, averaged over the data-parallel ranks, on the
    ranks slime logs its rollout metrics from (tensor-parallel rank 0 of the last pipeline stage)."""
    if figures is None:
        return
    from megatron.core import mpu  # lazy: optional dependency megatron-core
    from slime.observability.train_metric_utils import gather_log_data  # lazy: optional dependency slime

    if mpu.get_tensor_model_parallel_rank() == 0 and mpu.is_pipeline_last_stage():
        gather_log_data("teacher", args, rollout_id, dict(figures))


def student_buckets(args: Any, batch: dict, logits: Any,
                    invariant: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The student's [N, k] log-probs at the rollout's ids (padded slots of a union -inf) and [N]
    tails over the batch's response tokens: from the fused output, or (slime's logits path) from
    the logits by the top-k op in the step's `invariant` mode."""
    allgather = allgather_cp_active(args)
    if isinstance(logits, dict):
        if "topk_log_probs" not in logits:
            raise RuntimeError("slime_opd: the fused step ran without the top-k request; please report this")
        logp, tail = logits["topk_log_probs"], logits["tail"]
    else:
        rows = logits.reshape(-1, logits.shape[-1])
        positions = response_positions(batch, rows.shape[0], rows.device, allgather)
        logp, tail = logits_buckets(rows, batch, positions, allgather, float(args.rollout_temperature), invariant)
    # in the rows of slime's per-sample fields (teacher buckets, masks): zigzag ones under --allgather-cp
    return torch.cat(sample_rows(logp, batch, allgather)), torch.cat(sample_rows(tail, batch, allgather))


def topk_opd_policy_loss(args: Any, batch: dict, logits: Any, sum_of_sample_mean: Any) -> tuple[Any, dict]:
    """slime's custom loss: POLICY_WEIGHT · slime's policy loss + COEF · the top-k divergence
    between the student and the teachers' mixture (topk_kl; its per-token values averaged per
    sample by slime's `sum_of_sample_mean`), logged as "opd_topk_loss". The settings and the
    invariant mode are the step's, carried by the batch (`fused_step.FUSED_STEP`)."""
    from slime.backends.megatron_utils.loss import policy_loss_function  # slime is not a dependency

    step = fused_step_in(batch)
    settings, invariant = (None, None) if step is None else (step.settings, step.invariant)
    if settings is not None and settings.full_vocab:
        return vocab_opd.vocab_opd_loss(args, batch, logits, sum_of_sample_mean, settings)
    if settings is None or (batch.get(TEACHER_LOGPROBS) is None and batch.get(CROSS_RATIO) is None):
        raise ValueError(f"{LOSS_PATH} needs top-k OPD's teacher scores: set {TEACHERS} and apply the slime_opd "
                         "patch (megatron_rl_patches.apply(only=['slime_fused', 'slime_opd', ...]))")
    loss, log = policy_loss_function(args, batch, logits, sum_of_sample_mean)
    student, student_tail = student_buckets(args, batch, logits, invariant)
    if batch.get(CROSS_RATIO) is not None:  # a teacher with another tokenizer: every teacher's term
        terms = opd_terms.loss_terms(settings, batch, student, student_tail,
                                     cross_loss.token_log_probs(args, batch, logits), invariant)
    else:
        terms = opd_terms.mixture_terms(settings, batch, student, student_tail, invariant)
    opd = sum_of_sample_mean(terms)
    log["opd_topk_loss"] = opd.clone().detach()
    return settings.policy_weight * loss + settings.coef * opd, log
