"""Every verl record in one place (verl 0.9.x; 0.9.1 tested, the Megatron engine layout of 0.8+):
`verl_fused_logprobs` (the processor, in `fused`; the rows verl reads, in `rows`; shared-prefix
packing of the engine's passes, in `shared_prefix`) and
`verl_topk_kd` (in `topk`; its served teacher in `served`, its figures in verl's metrics in
`teacher_metrics`). The listing order is
`integrations.ORDER`'s. Every record is a no-op until verl's module is imported (post-import hooks)."""
from __future__ import annotations

from megatron_rl_patches.patching.records import Patch

HERE = "megatron_rl_patches.integrations.verl"
FUSED = "verl.models.mcore.model_forward_fused"
ENGINE = "verl.workers.engine.megatron.transformer_impl:MegatronEngineWithLMHead.forward_step"
PACKER = f"{FUSED}:preprocess_thd_engine"
VERSIONS = ">=0.9.0,<0.10"
_PROCESSOR_PARAMS = ("hidden_states", "output_layer", "output_weight", "labels", "context", "config")


def _fused(target: str, wrapper: str, description: str, params: tuple[str, ...], optional: bool = False) -> Patch:
    """A `verl_fused_logprobs` record (optional ones: another verl layout may lack the target)."""
    return Patch(name="verl_fused_logprobs", target=target, wrapper=f"{HERE}.{wrapper}", description=description,
                 requires="verl", versions=VERSIONS, optional=optional, params=params)


PATCHES = (
    _fused(f"{FUSED}:fused_output_processor", "fused:fused_output_processor_wrapper",
           "verl's fused output processor (Triton, CUDA only) replaced by the fused LM-head processor",
           _PROCESSOR_PARAMS),
    _fused(f"{FUSED}:fused_forward_model_engine", "fused:fused_engine_factory_wrapper",
           "verl's fused engine forward passes calculate_entropy down and drops a stale 'legacy' mode",
           ("vision_model",)),
    _fused("verl.models.mcore.registry:fused_forward_model_engine", "fused:fused_engine_factory_wrapper",
           "the same, where verl's model registry bound the name at import", ("vision_model",), optional=True),
    Patch(
        name="verl_topk_kd",
        target="verl.trainer.distillation.megatron.losses:compute_forward_kl_topk",
        wrapper=f"{HERE}.topk:compute_forward_kl_topk_wrapper",
        description="verl's clamped top-k forward KL replaced by the exact (k+1)-bucket KL (with a tail)",
        requires="verl",
        versions=VERSIONS,
        params=("student_logits", "teacher_topk_log_probs", "teacher_topk_ids", "config", "data_format"),
    ),
    Patch(
        name="verl_topk_kd",
        target="verl.trainer.distillation.losses:compute_topk_loss",
        wrapper=f"{HERE}.topk:compute_topk_loss_wrapper",
        description="verl's top-k loss as its logits processor: the exact KL in the invariant mode its micro-batch "
                    "carries",
        requires="verl",
        versions=VERSIONS,
        optional=True,
        params=("config", "distillation_config", "data", "student_logits", "data_format"),
    ),
    Patch(
        name="verl_topk_kd",
        target=ENGINE,
        wrapper=f"{HERE}.topk:forward_step_wrapper",
        description="verl's engine forward_step: its micro-batches carry the student's invariant mode (its model "
                    "config's batch_invariant_mode) to the top-k loss",
        requires="verl",
        versions=VERSIONS,
        optional=True,
        params=("self", "batch_iter", "model"),
    ),
    Patch(
        name="verl_topk_kd",
        target="verl.experimental.teacher_loop.teacher_manager:AsyncTeacherLLMServerManager."
               "compute_teacher_logprobs_single",
        wrapper=f"{HERE}.served:compute_teacher_logprobs_single_wrapper",
        description="verl's teacher-loop client answered by the served teacher MEGATRON_RL_PATCHES_VERL_TEACHER "
                    "names (unset: verl's own teacher replicas)",
        requires="verl",
        versions=VERSIONS,
        optional=True,
        params=("self", "sequence_ids", "multi_modal_data"),
    ),
    Patch(
        name="verl_topk_kd",
        target="verl.experimental.agent_loop.agent_loop:AgentLoopWorker._compute_teacher_logprobs",
        wrapper=f"{HERE}.served:compute_teacher_logprobs_wrapper",
        description="verl's agent-loop worker hands the sample's non-tensor fields to the served teacher "
                    "(MEGATRON_RL_PATCHES_VERL_TEACHER with ;context=KEY: a privileged context)",
        requires="verl",
        versions=VERSIONS,
        optional=True,
        params=("self", "output", "prompt_ids", "response_ids", "validate", "sample_kwargs"),
    ),
    Patch(
        name="verl_topk_kd",
        target="verl.experimental.agent_loop.agent_loop:AgentLoopWorker.generate_sequences",
        wrapper=f"{HERE}.teacher_metrics:generate_sequences_wrapper",
        description="verl's agent-loop worker's per-sample metrics carry its served teacher's figures since the "
                    "last step (MEGATRON_RL_PATCHES_VERL_TEACHER set)",
        requires="verl",
        versions=VERSIONS,
        optional=True,
        params=("self", "batch"),
    ),
    Patch(
        name="verl_topk_kd",
        target="verl.experimental.agent_loop.agent_loop:AgentLoopManager._performance_metrics",
        wrapper=f"{HERE}.teacher_metrics:performance_metrics_wrapper",
        description="verl's agent-loop timing dict gets the workers' served-teacher figures as teacher/... (logged "
                    "by verl's trainer as timing_s/teacher/...)",
        requires="verl",
        versions=VERSIONS,
        optional=True,
        params=("self", "metrics", "output"),
    ),
    _fused(ENGINE, "rows:forward_step_wrapper",
           "verl's engine forward_step notes the rows verl reads (responses, loss mask) for the fused route",
           ("self", "batch_iter", "model", "logits_processor_func", "postprocess_micro_batch_func"), optional=True),
    _fused(f"{ENGINE.rpartition(':')[0]}:MegatronEngine.forward_backward_batch",
           "shared_prefix:forward_backward_batch_wrapper",
           "verl's engine passes (training, log-probs, reference) pack a group's prompt once where verl packs each "
           "micro-batch (MEGATRON_RL_PATCHES_SHARED_PREFIX=1)",
           ("self", "data", "loss_function", "forward_only"), optional=True),
    _fused(PACKER, "rows:packer_wrapper",
           "verl's label packing packs the read rows alike: the fused processor's row mask",
           ("input_ids", "pre_process", "need_roll"), optional=True),
)
