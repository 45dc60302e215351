"""megatron-core: DistributedDataParallel forward-pre-hook toggles made idempotent, gradient
accumulation windows over several schedule calls, and GPTModel's `output_processor` keyword
backported to releases before 0.18."""
from __future__ import annotations

import inspect
from typing import Any

from megatron_rl_patches.integrations.megatron_version import SUPPORTED
from megatron_rl_patches.patching.records import Patch

DDP = "megatron.core.distributed.distributed_data_parallel:DistributedDataParallel"
GPT = "megatron.core.models.gpt.gpt_model:GPTModel"
HYBRID = "megatron.core.models.hybrid.hybrid_model:HybridModel"
MTP = "megatron.core.transformer.multi_token_prediction"
# process_mtp_loss (megatron-core >= 0.18) as the fused MTP loss calls it
MTP_LOSS_PARAMS = ("hidden_states", "labels", "loss_mask", "output_layer", "output_weight", "runtime_gather_output",
                   "is_training", "compute_language_model_loss", "config")
# get_forward_backward_func() returns one of these, looked up in the module at call time
SCHEDULES = "megatron.core.pipeline_parallel.schedules"
SCHEDULE_FUNCTIONS = (
    "forward_backward_no_pipelining",
    "forward_backward_pipelining_without_interleaving",
    "forward_backward_pipelining_with_interleaving",
)
# The version in use, also for a source checkout with no distribution metadata.
VERSION_FINDER = "megatron_rl_patches.integrations.megatron_version:installed_version"

PATCHES = (
    Patch(
        name="ddp_hooks",
        target=f"{DDP}.enable_forward_pre_hook",
        wrapper="megatron_rl_patches.integrations.megatron_core:enable_forward_pre_hook_wrapper",
        description="enable_forward_pre_hook() is a no-op when the hooks are already registered",
        versions=SUPPORTED,
        version_finder=VERSION_FINDER,
        params=("self",),
    ),
    Patch(
        name="ddp_hooks",
        target=f"{DDP}.disable_forward_pre_hook",
        wrapper="megatron_rl_patches.integrations.megatron_core:disable_forward_pre_hook_wrapper",
        description="disable_forward_pre_hook() with no hooks registered only does the param sync",
        versions=SUPPORTED,
        version_finder=VERSION_FINDER,
        params=("self", "param_sync"),
    ),
)

# Declared apart so patch names keep their order (the newest last) in listings and messages.
OUTPUT_PROCESSOR_PATCHES = (
    Patch(
        name="gpt_output_processor",
        target=f"{GPT}.forward",
        wrapper="megatron_rl_patches.integrations.megatron_core:gpt_forward_wrapper",
        description="GPTModel.forward(output_processor=, output_processor_context=) as in megatron-core >= 0.18",
        versions=SUPPORTED,
        version_finder=VERSION_FINDER,
        native=">=0.18.0rc0",
        params=("self", "input_ids", "position_ids", "attention_mask"),
        wrapper_class="megatron_rl_patches.integrations.gpt_signature:OutputProcessorForward",
    ),
)

# The fused head for HybridModel and for the MTP heads (issue 39), newest last.
HEAD_PATCHES = (
    Patch(
        name="hybrid_output_processor",
        target=f"{HYBRID}.forward",
        wrapper="megatron_rl_patches.integrations.processor_backport:hybrid_forward_wrapper",
        description="HybridModel.forward(output_processor=, output_processor_context=) as GPTModel's",
        versions=SUPPORTED,
        version_finder=VERSION_FINDER,
        native_params=("output_processor", "output_processor_context"),
        params=("self", "input_ids", "position_ids", "attention_mask", "decoder_input", "labels"),
        wrapper_class="megatron_rl_patches.integrations.gpt_signature:OutputProcessorForward",
    ),
    *(
        Patch(
            name="mtp_output_processor",
            target=target,
            wrapper="megatron_rl_patches.megatron.mtp_loss:process_mtp_loss_wrapper",
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
        wrapper="megatron_rl_patches.megatron.mtp_loss:acceptance_counts_wrapper",
        description="the MTP acceptance counts from the fused head's top-1 ids (no logits)",
        versions=SUPPORTED,
        version_finder=VERSION_FINDER,
        params=("mtp_logits", "mtp_labels", "loss_mask", "output_layer", "runtime_gather_output"),
        optional=True,
    ),
)

# Accumulation windows (the work is in megatron_rl_patches.windows), newest last.
WINDOW_PATCHES = tuple(
    Patch(
        name="grad_windows",
        target=f"{SCHEDULES}:{function}",
        wrapper="megatron_rl_patches.integrations.megatron_core:schedule_wrapper",
        description="schedule calls with finalize_model_grads_func unset accumulate until the next "
        "finish_grad_sync (overlap_grad_reduce reduces once, at the window's end)",
        versions=SUPPORTED,
        version_finder=VERSION_FINDER,
        params=("model", "forward_only"),
    )
    for function in SCHEDULE_FUNCTIONS
)


def _method_call(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> tuple[Any, inspect.BoundArguments] | None:
    """(chunk, arguments) of a call to a DDP method, bound or through the class (`self` in the
    arguments); None when the original should run unchanged: the call does not fit its
    signature, or the chunk is not DDP-like."""
    from megatron_rl_patches._args import bind
    from megatron_rl_patches._chunks import is_ddp_like

    bound = bind(wrapped, args, kwargs)
    if bound is None:
        return None
    chunk = instance if instance is not None else bound.arguments.get("self")
    return (chunk, bound) if is_ddp_like(chunk) else None


def enable_forward_pre_hook_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """`ddp_hooks`: DistributedDataParallel.enable_forward_pre_hook is a no-op when hooks are registered."""
    from megatron_rl_patches.reentrant import enable_with

    call = _method_call(wrapped, instance, args, kwargs)
    if call is None:
        return wrapped(*args, **kwargs)
    return enable_with(call[0], lambda: wrapped(*args, **kwargs))


def disable_forward_pre_hook_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """`ddp_hooks`: DistributedDataParallel.disable_forward_pre_hook with no hooks registered
    only runs the requested param sync."""
    from megatron_rl_patches.reentrant import disable_with

    call = _method_call(wrapped, instance, args, kwargs)
    if call is None:
        return wrapped(*args, **kwargs)
    chunk, bound = call
    param_sync = bool(bound.arguments.get("param_sync", True))
    return disable_with(chunk, param_sync, lambda: wrapped(*args, **kwargs))


def schedule_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """`grad_windows`: a training schedule call with `config.finalize_model_grads_func` unset is part
    of an accumulation window that ends at the next finish_grad_sync / finalize_model_grads
    (see megatron_rl_patches.windows); any other call runs unchanged."""
    from megatron_rl_patches._args import bind

    bound = bind(wrapped, args, kwargs)
    if bound is None or bound.arguments.get("forward_only") or bound.arguments.get("model") is None:
        return wrapped(*args, **kwargs)
    from megatron_rl_patches._chunks import as_chunks
    from megatron_rl_patches.reentrant import model_config
    from megatron_rl_patches.windows import open_auto_windows, overlaps_grad_reduce

    chunks = [chunk for chunk in as_chunks(bound.arguments["model"]) if overlaps_grad_reduce(chunk)]
    if chunks:
        config = model_config(chunks[0])
        if config is not None and getattr(config, "finalize_model_grads_func", None) is None:
            open_auto_windows(chunks)
    return wrapped(*args, **kwargs)


def gpt_forward_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """`gpt_output_processor`: the processor gets the output layer's inputs in place of the logits
    and its result is returned, with the keywords megatron-core 0.18 passes."""
    from megatron_rl_patches.integrations.processor_backport import forward_with_processor

    return forward_with_processor(wrapped, instance, args, kwargs)
