"""megatron-core >= 0.18's `output_processor=` / `output_processor_context=` keywords for a language
model's forward that lacks them: GPTModel before 0.18 (patch `gpt_output_processor`) and
HybridModel / MambaModel on every release that has it (patch `hybrid_output_processor`).

The model's own forward runs up to its output layer; the layer is called as usual (its forward
pre-hooks run, DDP's param-gather wait among them) but its `forward` is replaced, for this call,
by one that stops the model there. The processor then gets those hidden states with the keywords
megatron-core 0.18 passes, and its result is returned. Multi-token prediction heads: from 0.18 on
their loss is `process_mtp_loss`, which must be patch `mtp_output_processor`'s (it never calls the
output layer); before 0.18 the forward calls the output layer once per MTP depth before the main
head, and those calls get the fused head (`FusedHeadLogits`) and its cross-entropy instead.
The two patches' wrappers are `gpt_backport.gpt_forward_wrapper` and `hybrid_backport.hybrid_forward_wrapper`.
"""
from __future__ import annotations

import inspect
from typing import Any

from megatron_rl_patches.model.arguments import bind
from megatron_rl_patches.patching.shadow import shadowed
from megatron_rl_patches.processors.gpt_signature import KEYWORDS as PROCESSOR_KEYWORDS
from megatron_rl_patches.processors.heads import output_layer_pre_hooks_ran
from megatron_rl_patches.processors.mtp_loss import FusedHeadLogits, fused_loss, fused_mtp_loss_in_effect


class _OutputLayerReached(Exception):
    """Raised by the stand-in output-layer forward: carries the hidden states it was given."""

    def __init__(self, hidden_states: Any) -> None:
        super().__init__("output layer reached")
        self.hidden_states = hidden_states


def _hidden_states_before_output_layer(model: Any, wrapped: Any, args: tuple, kwargs: dict, mtp_depths: int) -> Any:
    """Run the model's forward up to its output layer and return what the layer would get. The
    first `mtp_depths` calls of the layer (the MTP heads of megatron-core < 0.18, which call it
    before the main head) get the fused head instead of logits, and so does their loss."""
    layer = model.output_layer
    heads: list[None] = []

    def stop_here(hidden_states: Any, *unused: Any, weight: Any = None, **unused_kw: Any) -> Any:
        if len(heads) < mtp_depths:
            heads.append(None)
            return FusedHeadLogits(hidden_states, layer, weight, model.config), None
        raise _OutputLayerReached(hidden_states)

    loss = {"compute_language_model_loss": fused_loss(model.compute_language_model_loss)} if mtp_depths else {}
    with shadowed(layer, forward=stop_here), shadowed(model, **loss):
        try:
            wrapped(*args, **kwargs)
        except _OutputLayerReached as reached:
            return reached.hidden_states
    raise RuntimeError(
        f"{type(model).__name__}.forward returned without calling its output layer; cannot run output_processor"
    )


def _mtp_runs(model: Any) -> bool:
    """Whether this forward computes multi-token-prediction losses on this stage."""
    return bool(getattr(model.config, "mtp_num_layers", None)) and bool(getattr(model, "mtp_process", True))


def _mtp_labels_given(given: dict) -> bool:
    """Whether this forward's MTP heads run: always on megatron-core's own forward; with slime's
    Megatron patch (a `mtp_kwargs` keyword) only when `mtp_kwargs` carries `mtp_labels`."""
    if "mtp_kwargs" not in given:
        return True
    return (given["mtp_kwargs"] or {}).get("mtp_labels") is not None


def _inline_mtp_depths(model: Any, wrapped: Any, given: dict) -> int:
    """How many MTP heads call the output layer before the main head in this forward (`given`: its
    bound arguments): megatron-core < 0.18 computes their loss inline (the backport serves them
    through the fused head); from 0.18 on `process_mtp_loss` does, which must be patch
    `mtp_output_processor`'s (0: nothing inline)."""
    if not _mtp_runs(model) or not _mtp_labels_given(given):
        return 0

    namespace = getattr(getattr(wrapped, "__func__", wrapped), "__globals__", {})
    if "process_mtp_loss" not in namespace:
        return int(model.config.mtp_num_layers)
    if not fused_mtp_loss_in_effect(namespace):
        raise ValueError(
            f"output_processor with multi-token prediction (config.mtp_num_layers) on this {type(model).__name__} "
            "needs the MTP heads' loss routed through the fused head (patch mtp_output_processor, in `all`): "
            "apply it too, or drop output_processor"
        )
    return 0


def forward_with_processor(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """The model's forward with the backported keywords: the processor gets the output layer's
    inputs in place of the logits and its result is returned; a call without them, or a forward
    that has them itself, runs unchanged."""
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
    bound = bind(wrapped, args, kwargs)
    if bound is None:  # a call that does not fit: the forward raises its own TypeError
        return wrapped(*args, **kwargs)
    given = bound.arguments
    mtp_depths = _inline_mtp_depths(instance, wrapped, given)
    hidden_states = _hidden_states_before_output_layer(instance, wrapped, args, kwargs, mtp_depths)
    output_weight = (instance.shared_embedding_or_output_weight() if instance.share_embeddings_and_output_weights
                     else None)

    with output_layer_pre_hooks_ran(instance.output_layer):  # the call above ran them: once per forward
        return _call_processor(processor, instance, given, hidden_states, output_weight, context)


def _call_processor(processor: Any, instance: Any, given: dict, hidden_states: Any, output_weight: Any,
                    context: Any) -> Any:
    """The processor called with the keywords megatron-core 0.18 passes."""
    scale = getattr(instance, "_scale_logits", None)  # MuP scaling (0.19+); none before
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
        scale_logits=scale if callable(scale) else (lambda logits: logits),
        config=instance.config,
    )

