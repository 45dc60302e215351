"""GPTModel's `output_processor=` / `output_processor_context=` keywords (megatron-core >= 0.18)
backported to releases before 0.18: the wrapper of patch `gpt_output_processor` (declared in
`megatron_rl_patches.integrations.megatron.patches`; the signature it shows is `gpt_signature`'s)."""
from __future__ import annotations

import inspect
from typing import Any

PROCESSOR_KEYWORDS = ("output_processor", "output_processor_context")


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
    from megatron_rl_patches.processors.heads import output_layer_pre_hooks_ran

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
