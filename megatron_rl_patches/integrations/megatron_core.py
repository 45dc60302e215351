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
# get_forward_backward_func() returns one of these, looked up in the module at call time
SCHEDULES = "megatron.core.pipeline_parallel.schedules"
SCHEDULE_FUNCTIONS = (
    "forward_backward_no_pipelining",
    "forward_backward_pipelining_without_interleaving",
    "forward_backward_pipelining_with_interleaving",
)
# The version in use, also for a source checkout with no distribution metadata.
VERSION_FINDER = "megatron_rl_patches.integrations.megatron_version:installed_version"
PROCESSOR_KEYWORDS = ("output_processor", "output_processor_context")

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


class _OutputLayerReached(Exception):
    """Raised by the stand-in output-layer forward: carries the hidden states it was given."""

    def __init__(self, hidden_states: Any) -> None:
        super().__init__("output layer reached")
        self.hidden_states = hidden_states


def _hidden_states_before_output_layer(model: Any, wrapped: Any, args: tuple, kwargs: dict) -> Any:
    """Run GPTModel.forward up to its output layer and return what the layer would get.

    The layer is called as usual (so its forward pre-hooks run, DDP's param-gather wait among
    them); only its `forward` is replaced, for this call, by one that stops the model there.
    """
    layer = model.output_layer

    def stop_here(hidden_states: Any, *unused: Any, **unused_kw: Any) -> Any:
        raise _OutputLayerReached(hidden_states)

    missing = object()
    own = layer.__dict__.get("forward", missing)  # a forward the user set on the instance: restored after
    layer.forward = stop_here  # an instance attribute: the class's forward is untouched
    try:
        wrapped(*args, **kwargs)
    except _OutputLayerReached as reached:
        return reached.hidden_states
    finally:
        if layer.__dict__.get("forward") is stop_here:
            if own is missing:
                del layer.forward
            else:
                layer.__dict__["forward"] = own
    raise RuntimeError("GPTModel.forward returned without calling its output layer; cannot run output_processor")


def gpt_forward_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """`gpt_output_processor`: the processor gets the output layer's inputs in place of the logits
    and its result is returned, with the keywords megatron-core 0.18 passes."""
    if not any(name in kwargs for name in PROCESSOR_KEYWORDS):
        return wrapped(*args, **kwargs)
    signature = inspect.signature(wrapped)
    if "output_processor" in signature.parameters:  # this megatron-core has the hook itself
        return wrapped(*args, **kwargs)
    kwargs = dict(kwargs)
    processor = kwargs.pop("output_processor", None)
    context = kwargs.pop("output_processor_context", None)
    if processor is None:
        return wrapped(*args, **kwargs)
    if not callable(processor):
        raise TypeError(f"output_processor must be callable (see log_prob_output_processor), got {processor!r}")
    if not instance.post_process:  # not the last pipeline stage: hidden states go on, as natively
        return wrapped(*args, **kwargs)
    if getattr(instance.config, "mtp_num_layers", None):
        raise ValueError(
            "output_processor with multi-token prediction (config.mtp_num_layers) is not backported to "
            "megatron-core < 0.18: the MTP heads also call the output layer; upgrade or drop output_processor"
        )
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    given = bound.arguments
    hidden_states = _hidden_states_before_output_layer(instance, wrapped, args, kwargs)
    output_weight = (instance.shared_embedding_or_output_weight() if instance.share_embeddings_and_output_weights
                     else None)
    from megatron_rl_patches.megatron.processors import output_layer_pre_hooks_ran

    with output_layer_pre_hooks_ran(instance.output_layer):  # the call above ran them: once per forward
        return _call_processor(processor, instance, given, hidden_states, output_weight, context)


def _call_processor(processor: Any, instance: Any, given: dict, hidden_states: Any, output_weight: Any,
                    context: Any) -> Any:
    """The processor called with the keywords megatron-core 0.18 passes."""
    return processor(
        hidden_states=hidden_states,
        output_layer=instance.output_layer,
        output_weight=output_weight,
        labels=given.get("labels"),
        loss_mask=given.get("loss_mask"),
        input_ids=given.get("input_ids"),
        position_ids=given.get("position_ids"),
        attention_mask=given.get("attention_mask"),
        decoder_input=given.get("decoder_input"),
        inference_context=given.get("inference_context"),
        packed_seq_params=given.get("packed_seq_params"),
        runtime_gather_output=given.get("runtime_gather_output"),
        context=context,
        compute_language_model_loss=instance.compute_language_model_loss,
        scale_logits=lambda logits: logits,  # releases before 0.18 have no MuP logit scaling
        config=instance.config,
    )
