"""Every megatron record in one place: megatron-core's (DistributedDataParallel forward-pre-hook
toggles made idempotent, GPTModel's `output_processor` keyword backported to releases before
0.18, gradient accumulation windows over several schedule calls) and Megatron-LM's train()
re-entry (megatron.training, not in the megatron-core wheel before 0.17). The listing order is
`integrations.ORDER`'s."""
from __future__ import annotations

from megatron_rl_patches.integrations.megatron.train_reentry import train_reentry_patches
from megatron_rl_patches.integrations.megatron.version import SUPPORTED
from megatron_rl_patches.patching.records import Patch

CORE = "megatron_rl_patches.integrations.megatron.core"
BACKPORT = "megatron_rl_patches.processors.gpt_backport"
DDP = "megatron.core.distributed.distributed_data_parallel:DistributedDataParallel"
GPT = "megatron.core.models.gpt.gpt_model:GPTModel"
HYBRID = "megatron.core.models.hybrid.hybrid_model:HybridModel"
MTP = "megatron.core.transformer.multi_token_prediction"
MTP_LOSS = "megatron_rl_patches.processors.mtp_loss"
# process_mtp_loss (megatron-core >= 0.18) as the fused MTP loss calls it
MTP_LOSS_PARAMS = ("hidden_states", "labels", "loss_mask", "output_layer", "output_weight", "runtime_gather_output",
                   "is_training", "compute_language_model_loss", "config")
TRAINING = "megatron.training.training"
# get_forward_backward_func() returns one of these, looked up in the module at call time
SCHEDULES = "megatron.core.pipeline_parallel.schedules"
SCHEDULE_FUNCTIONS = (
    "forward_backward_no_pipelining",
    "forward_backward_pipelining_without_interleaving",
    "forward_backward_pipelining_with_interleaving",
)
# The version in use, also for a source checkout with no distribution metadata.
VERSION_FINDER = "megatron_rl_patches.integrations.megatron.version:installed_version"

PATCHES = (
    Patch(
        name="ddp_hooks",
        target=f"{DDP}.enable_forward_pre_hook",
        wrapper=f"{CORE}:enable_forward_pre_hook_wrapper",
        description="enable_forward_pre_hook() is a no-op when the hooks are already registered",
        versions=SUPPORTED,
        version_finder=VERSION_FINDER,
        params=("self",),
    ),
    Patch(
        name="ddp_hooks",
        target=f"{DDP}.disable_forward_pre_hook",
        wrapper=f"{CORE}:disable_forward_pre_hook_wrapper",
        description="disable_forward_pre_hook() with no hooks registered only does the param sync",
        versions=SUPPORTED,
        version_finder=VERSION_FINDER,
        params=("self", "param_sync"),
    ),
    *train_reentry_patches(TRAINING, ("forward_step_func", "model", "optimizer"), "Megatron-LM"),
    Patch(
        name="gpt_output_processor",
        target=f"{GPT}.forward",
        wrapper=f"{BACKPORT}:gpt_forward_wrapper",
        description="GPTModel.forward(output_processor=, output_processor_context=) as in megatron-core >= 0.18",
        versions=SUPPORTED,
        version_finder=VERSION_FINDER,
        native=">=0.18.0rc0",
        params=("self", "input_ids", "position_ids", "attention_mask"),
        wrapper_class="megatron_rl_patches.processors.gpt_signature:OutputProcessorForward",
    ),
    # Accumulation windows (the work is in megatron_rl_patches.windows).
    *(
        Patch(
            name="grad_windows",
            target=f"{SCHEDULES}:{function}",
            wrapper=f"{CORE}:schedule_wrapper",
            description="schedule calls with finalize_model_grads_func unset accumulate until the next "
            "finish_grad_sync (overlap_grad_reduce reduces once, at the window's end)",
            versions=SUPPORTED,
            version_finder=VERSION_FINDER,
            params=("model", "forward_only"),
        )
        for function in SCHEDULE_FUNCTIONS
    ),
    # The fused head for HybridModel and for the MTP heads (issue 39).
    Patch(
        name="hybrid_output_processor",
        target=f"{HYBRID}.forward",
        wrapper="megatron_rl_patches.processors.hybrid_backport:hybrid_forward_wrapper",
        description="HybridModel.forward(output_processor=, output_processor_context=) as GPTModel's",
        versions=SUPPORTED,
        version_finder=VERSION_FINDER,
        native_params=("output_processor", "output_processor_context"),
        params=("self", "input_ids", "position_ids", "attention_mask", "decoder_input", "labels"),
        wrapper_class="megatron_rl_patches.processors.gpt_signature:OutputProcessorForward",
    ),
    *(
        Patch(
            name="mtp_output_processor",
            target=target,
            wrapper=f"{MTP_LOSS}:process_mtp_loss_wrapper",
            description="the MTP heads' cross-entropy from their hidden states through the fused head: no logits",
            versions=SUPPORTED,
            version_finder=VERSION_FINDER,
            params=MTP_LOSS_PARAMS,
            optional=True,
        )
        # optional: releases before 0.18 compute the MTP loss inline (no such function); the models
        # bind it at import, so a model module imported before apply() holds megatron's own
        for target in (f"{MTP}:process_mtp_loss", f"{GPT.partition(':')[0]}:process_mtp_loss",
                       f"{HYBRID.partition(':')[0]}:process_mtp_loss")
    ),
    Patch(
        name="mtp_output_processor",
        target=f"{MTP}:_compute_mtp_acceptance_counts",
        wrapper=f"{MTP_LOSS}:acceptance_counts_wrapper",
        description="the MTP acceptance counts from the fused head's top-1 ids (no logits)",
        versions=SUPPORTED,
        version_finder=VERSION_FINDER,
        params=("mtp_logits", "mtp_labels", "loss_mask", "output_layer", "runtime_gather_output"),
        optional=True,
    ),
)
