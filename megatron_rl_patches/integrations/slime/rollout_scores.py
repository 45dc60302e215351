"""slime's served teachers asked as each sample's generation ends (`MEGATRON_RL_PATCHES_OPD_SCORE_AT=
rollout`; the default, `train`, leaves them to the train step: docs/benchmarks.md, "A served teacher
off the train step"). slime 624b824a applies its rollout sample hooks in `generate_and_rm` after a
sample's generation, before its reward; `slime_opd` adds `score_sample` to them (`hooks_wrapper`,
around `apply_rollout_sample_hooks`; naming it in `--rollout-sample-hook-path` is the same, once).
Each sample goes to the rollout's teachers (`integrations.megatron.opd.rollout_teachers`, built from
MEGATRON_RL_PATCHES_OPD_TEACHERS and kept on slime's `args`) with its privileged context from its
`train_metadata` (`;context=KEY`); the hook awaits the answers without blocking the other samples and
puts the rows in `train_metadata` (`carried_rows`, read by the train step where they still match),
which slime's split carries to the training ranks (`contexts.split_wrapper`). The teachers' figures of
each rollout go into slime's rollout metrics under `teacher/...` (`log_rollout_data_wrapper`)."""
# lazy imports: optional dependency slime (and httpx, the extra `served`)
from __future__ import annotations

from typing import Any

from megatron_rl_patches._log import warn_once
from megatron_rl_patches.integrations.megatron.opd.carried_rows import ROWS
from megatron_rl_patches.integrations.megatron.opd.opd_settings import (
    SCORE_AT,
    TEACHERS,
    score_at,
)
from megatron_rl_patches.integrations.megatron.opd.rollout_teachers import (
    RolloutTeachers,
    ask_rows,
)
from megatron_rl_patches.integrations.slime.fused_step import slime_settings
from megatron_rl_patches.model.arguments import bind
from megatron_rl_patches.settings import SELECT

HOOK = "megatron_rl_patches.integrations.slime.rollout_scores.score_sample"  # its --rollout-sample-hook-path
ATTRIBUTE = "megatron_rl_patches_rollout_teachers"  # on slime's args in the rollout manager's process
WHERE = "slime_opd (the rollout's sample hook, score_sample)"  # where a rollout-time refusal was asked
# the rollout asked to score finds no teachers in its process: the settings went to the training actors only
NO_TEACHERS = (f"slime_opd: {SCORE_AT}=rollout is set in slime's rollout manager, but {TEACHERS} is not: no sample is "
               f"scored at the rollout and the train step asks every served teacher; set {TEACHERS} (with {SELECT} "
               f"and the other OPD variables) in the job's runtime_env, which reaches the rollout manager "
               f"(--train-env-vars reaches the training actors only)")


def rollout_teachers(args: Any) -> RolloutTeachers | None:
    """The rollout's teachers, built at first use and kept on slime's `args` (None: nothing is
    asked at the rollout; that answer kept too: a job without a served teacher reads its settings
    once, not once a sample)."""
    held = getattr(args, ATTRIBUTE, None)
    if not isinstance(held, RolloutTeachers):
        settings = slime_settings(args)
        if settings is None and score_at() == "rollout":
            warn_once(NO_TEACHERS)
        held = RolloutTeachers(settings, args)
        setattr(args, ATTRIBUTE, held)
    return held if held.teachers else None


def sample_contexts(held: RolloutTeachers, sample: Any) -> list[dict] | None:
    """The privileged contexts of slime's `sample` (its train_metadata, named by its rollout index)
    for the rollout's teachers: `RolloutTeachers.sample_contexts`."""
    return held.sample_contexts(sample.train_metadata, sample.index, WHERE)


async def score_sample(args: Any, sample: Any, *, rollout_id: int | None = None, evaluation: bool = False) -> None:
    """slime's rollout sample hook: `sample` sent to the rollout's served teachers now, its rows
    put in its train_metadata (an evaluation's samples, an aborted one or one without a response:
    left alone). A failure raises the teacher's named error (see the module's words)."""
    held = None if evaluation else rollout_teachers(args)
    if held is None or not held.teachers or getattr(getattr(sample, "status", None), "name", "") == "ABORTED":
        return None
    if sample.train_metadata is None:
        sample.train_metadata = {}  # every sample alike: slime carries train_metadata only when the first has one
    response = int(sample.response_length or 0)
    if not response:
        return None
    rows = await ask_rows(held, sample.tokens, response, sample_contexts(held, sample), sample=sample.index,
                          where=WHERE)
    sample.train_metadata.setdefault(ROWS, {}).update(rows)
    return None


def hooks_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper for slime's `apply_rollout_sample_hooks(args, value, **kwargs)` as its rollout
    module calls it after each generation: slime's hooks, then `score_sample` on every sample of
    `value` (unless `--rollout-sample-hook-path` already names it)."""
    bound = bind(wrapped, args, kwargs)
    slime_args = None if bound is None else bound.arguments.get("args")
    paths = getattr(slime_args, "rollout_sample_hook_path", None) or []
    if bound is None or slime_args is None or HOOK in paths or rollout_teachers(slime_args) is None:
        return wrapped(*args, **kwargs)
    extra = dict(bound.arguments.get("kwargs") or {})

    async def hooked() -> Any:
        value = await wrapped(*args, **kwargs)
        for sample in value if isinstance(value, list) else [value]:
            await score_sample(slime_args, sample, rollout_id=extra.get("rollout_id"),
                               evaluation=bool(extra.get("evaluation", False)))
        return value

    return hooked()


def log_rollout_data_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper for the rollout manager's `log_rollout_data(rollout_id, args, samples,
    rollout_extra_metrics, rollout_time)`: the rollout's teachers' figures added to slime's extra
    metrics as `teacher/...` keys (wandb and its log line show them)."""
    bound = bind(wrapped, args, kwargs)
    held = None if bound is None else getattr(bound.arguments.get("args"), ATTRIBUTE, None)
    if bound is None or not isinstance(held, RolloutTeachers) or not held.teachers:
        return wrapped(*args, **kwargs)
    from megatron_rl_patches.teachers.step.metrics import flat  # lazy: import cost: the step's module

    extra = bound.arguments.get("rollout_extra_metrics") or {}
    bound.arguments["rollout_extra_metrics"] = {**extra, **flat(held.metrics())}
    return wrapped(*bound.args, **bound.kwargs)
