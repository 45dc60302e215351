"""Every slime record in one place (slime 624b824a, and forks vendoring its module names): train()
re-entry, inference-only roles, the log-prob adapter, the fused route (`slime_fused`) and top-k
OPD (`slime_opd`). The listing order is `integrations.ORDER`'s.

slime ships no version metadata we can rely on, so these records carry no version range; the
parameter lists are the guard.
"""
from __future__ import annotations

from typing import Any

from megatron_rl_patches.integrations.megatron.opd.opd_settings import opd_settings, score_at
from megatron_rl_patches.integrations.megatron.opd.served_checks import check_served
from megatron_rl_patches.integrations.megatron.train_reentry import train_reentry_patches
from megatron_rl_patches.patching.records import Patch
from megatron_rl_patches.settings import shared_prefix

HERE = "megatron_rl_patches.integrations.slime"
MODEL = "slime.backends.megatron_utils.model"
LOSS = "slime.backends.megatron_utils.loss"
ACTOR = "slime.backends.megatron_utils.actor"
METRICS = "slime.observability.train_metric_utils"
ROLLOUT = "slime.ray.rollout"  # the rollout manager's module (its process applies the patches too)
SCHEDULE = "slime.utils.dp_schedule"  # the rollout manager's micro-batch schedule (its first fit)
GENERATE = "slime.rollout.sglang_rollout"  # the rollout's generate_and_rm (in the rollout manager's process)
SLIME_TRAIN_PARAMS = ("rollout_id", "model", "optimizer", "opt_param_scheduler", "data_iterator")
SLIME_LOGPROB_PARAMS = ("logits", "tokens", "tp_group")
# a role at its own layout (role;tp=N)
LAYOUT_PASS = "megatron_rl_patches.integrations.megatron.opd.layout_role_pass:forward_only_wrapper"
LOGPROBS = f"{HERE}.logprobs:calculate_log_probs_and_entropy_wrapper"


def _record(name: str, target: str, wrapper: str, description: str, params: tuple[str, ...],
            optional: bool = False) -> Patch:
    return Patch(name=name, target=target, wrapper=wrapper, description=description, requires=None, params=params,
                 optional=optional)


def _fused(target: str, wrapper: str, description: str, params: tuple[str, ...], optional: bool = False) -> Patch:
    return _record("slime_fused", target, f"{HERE}.fused:{wrapper}", description, params, optional)


def _opd(target: str, wrapper: str, description: str, params: tuple[str, ...], optional: bool = False) -> Patch:
    return _record("slime_opd", target, f"{HERE}.{wrapper}", description, params, optional)


PATCHES = (
    *train_reentry_patches(MODEL, SLIME_TRAIN_PARAMS, "slime"),
    _record("inference_roles", f"{MODEL}:initialize_model_and_optimizer",
            f"{HERE}.roles:initialize_model_and_optimizer_wrapper",
            "roles in MEGATRON_RL_PATCHES_INFERENCE_ROLES built inference-only", ("args", "role")),
    _record("inference_roles", f"{MODEL}:forward_only", LAYOUT_PASS,
            "slime's log-prob pass of a role at its own layout (role;tp=N) through score_at_layout",
            ("f", "args", "model", "data_iterator", "num_microbatches", "store_prefix")),
    _record("inference_roles", f"{ACTOR}:forward_only", LAYOUT_PASS,
            "the same, where slime's actor bound forward_only at import", ("f", "args", "model"), optional=True),
    _record("slime_logprobs", "slime.utils.ppo_utils:calculate_log_probs_and_entropy", LOGPROBS,
            "slime's log-prob/entropy replaced by the memory-optimal Function", SLIME_LOGPROB_PARAMS),
    _record("slime_logprobs", f"{LOSS}:calculate_log_probs_and_entropy", LOGPROBS,
            "the same, where slime's loss module bound the name at import", SLIME_LOGPROB_PARAMS, optional=True),
    *(_record("slime_logprobs", target, f"{HERE}.logprobs:student_step_wrapper",
              f"{what}: the logits its callback gets carry the student's invariant mode (its model config's "
              "batch_invariant_mode)", ("f", "args", "model"), optional=optional)
      for target, what, optional in (
          (f"{MODEL}:forward_only", "slime's forward_only", False),
          (f"{ACTOR}:forward_only", "the same, where slime's actor bound forward_only at import", True))),
    _fused(f"{MODEL}:forward_only", "forward_only_wrapper", "slime's forward_only on the fused log-prob processor",
           ("f", "args", "model", "data_iterator", "num_microbatches", "store_prefix")),
    _fused(f"{MODEL}:train_one_step", "train_one_step_wrapper", "slime's train_one_step on the fused processor",
           ("args", "rollout_id", "step_id", "data_iterator", "model", "optimizer")),
    _fused(f"{MODEL}:get_batch", "get_batch_wrapper", "the micro-batch noted for the fused model call",
           ("data_iterator", "keys")),
    _fused(f"{MODEL}:get_forward_backward_func", "schedule_wrapper",
           "slime's forward step given a model that calls the output processor", ()),
    _fused(f"{LOSS}:get_log_probs_and_entropy", "log_probs_wrapper",
           "slime's response slicing on the processor's per-token results",
           ("logits", "args", "unconcat_tokens", "total_lengths", "response_lengths", "with_entropy")),
    _fused(f"{ACTOR}:forward_only", "forward_only_wrapper",
           "the same, where slime's actor bound forward_only at import", ("f", "args", "model"), optional=True),
    *(_record("slime_fused", target, f"{HERE}.micro_batches:{wrapper}", description, params, optional=True)
      for target, wrapper, description, params in (
          (f"{ROLLOUT}:RolloutManager._split_train_data_by_dp", "split_wrapper",
           "with shared-prefix packing on, the rollout's tokens held while slime schedules its micro-batches",
           ("self", "data")),
          (f"{ROLLOUT}:build_dp_schedule", "schedule_wrapper",
           "the schedule's sample lengths knowing their samples (with shared-prefix packing on)",
           ("args", "train_parallel_config", "total_lengths")),
          (f"{SCHEDULE}:first_fit_pack", "first_fit_wrapper",
           "--max-tokens-per-gpu counting the tokens the model computes: a group's prompt once, the group whole "
           "where it fits (with shared-prefix packing on)", ("total_lengths", "max_tokens_per_bin")))),
    _opd(f"{ACTOR}:MegatronTrainRayActor.init", "opd:init_wrapper",
         "top-k OPD teachers loaded after slime's actor init (MEGATRON_RL_PATCHES_OPD_TEACHERS)",
         ("self", "args", "role", "with_ref", "with_opd_teacher")),
    _opd(f"{ACTOR}:MegatronTrainRayActor.train_actor", "opd:train_actor_wrapper",
         "the actor's top-k ids, then every teacher's scores, before slime's train_actor",
         ("self", "rollout_id", "rollout_data")),
    _opd(f"{METRICS}:log_rollout_data", "opd:log_rollout_data_wrapper",
         "top-k OPD's rollout-data fields (ids, teacher scores) kept out of slime's rollout metrics",
         ("rollout_id", "args", "rollout_data")),
    _opd(f"{ROLLOUT}:RolloutManager._split_train_data_by_dp", "contexts:split_wrapper",
         "the rollout manager's per-rank split carries each sample's train_metadata keys named by "
         "';context=KEY' teachers (slime copies a fixed list of keys)", ("self", "data"), optional=True),
    _opd(f"{ROLLOUT}:tensorize_rollout_data_for_training", "contexts:tensorize_wrapper",
         "each rank's samples' contexts put in its rollout data as the split packages it", ("rollout_data",),
         optional=True),
    _opd(f"{GENERATE}:apply_rollout_sample_hooks", "rollout_scores:hooks_wrapper",
         "each sample sent to the served teachers as its generation ends, its rows carried with it "
         "(MEGATRON_RL_PATCHES_OPD_SCORE_AT=rollout)", ("args", "value"), optional=True),
    _opd(f"{ROLLOUT}:log_rollout_data", "rollout_scores:log_rollout_data_wrapper",
         "the rollout's served teachers' figures in slime's rollout metrics (teacher/...)",
         ("rollout_id", "args", "samples", "rollout_extra_metrics", "rollout_time"), optional=True),
)


def check_settings(environ: Any = None) -> None:
    """slime's own variables (top-k OPD's MEGATRON_RL_PATCHES_OPD_*), read as slime_opd reads them,
    and what the actor refuses of them before anything loads (a served teacher's ids: `check_served`):
    a ValueError naming the variable at fault (integrations.check_settings calls every framework's).
    MEGATRON_RL_PATCHES_OPD_SCORE_AT is checked even without the teachers: the rollout manager's
    environment, where it is read, may be checked apart from the training actors'.
    MEGATRON_RL_PATCHES_SHARED_PREFIX is read as slime_fused's passes read it."""
    shared_prefix(environ)
    score_at(environ)
    settings = opd_settings(environ)
    if settings is not None:
        check_served(settings)
