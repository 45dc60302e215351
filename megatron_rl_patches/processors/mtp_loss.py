"""Patch `mtp_output_processor`: the multi-token-prediction heads' loss without logits.

megatron-core >= 0.18 computes each MTP depth's cross-entropy in `process_mtp_loss` from dense
[s, b, V/tp] logits (`output_layer(hidden)`, then `compute_language_model_loss`), even when the
main head runs through an output processor. The wrapper calls megatron's own `process_mtp_loss`
(its label and mask rolling, `mtp_detach_heads`, loss scaling, logging and `MTPLossAutoScaler`
stay megatron's) with a stand-in output layer that returns the depth's hidden states as
:class:`FusedHeadLogits` instead of logits, and a loss that takes those through the fused LM head
(`lm_head_log_probs_and_entropy`): the same cross-entropy and gradients, no [T, V] tensor. The
acceptance counts megatron logs while training take the fused head's top-1 ids.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

import megatron_rl_patches.ops.lm_head as lm_head_ops  # the module: a wrapper set on an op is what runs
from megatron_rl_patches.model.arguments import bind
from megatron_rl_patches.ops.invariance import resolve_invariant
from megatron_rl_patches.patching import wrappers
from megatron_rl_patches.processors.heads import ProcessorCall

PATCH_NAME = "mtp_output_processor"


class FusedHeadLogits:
    """One MTP depth's logits, not computed: the hidden states [s(/tp under SP), b, h] that the
    output layer would have projected, with the layer, the weight it would have used and the
    model config (a MuP output multiplier goes into the temperature, as the processors do; its
    batch_invariant_mode the ops' invariant mode, the setting first)."""

    def __init__(self, hidden_states: torch.Tensor, output_layer: torch.nn.Module, weight: torch.Tensor | None,
                 config: Any) -> None:
        self.hidden_states, self.output_layer, self.weight, self.config = hidden_states, output_layer, weight, config
        self.invariant = resolve_invariant(None, config)

    def _call(self, labels: torch.Tensor | None) -> ProcessorCall:
        return ProcessorCall(self.hidden_states, self.output_layer, self.weight, labels, self.config, 1.0, {})

    def cross_entropy(self, labels: torch.Tensor) -> torch.Tensor:
        """-log p(label) [b, s], as `compute_language_model_loss(labels, logits)` gives it."""
        call = self._call(labels)
        assert call.labels is not None
        log_probs, _ = lm_head_ops.lm_head_log_probs_and_entropy(
            call.hidden, call.weight, call.labels, tp_group=call.tp_group, sequence_parallel=call.sequence_parallel,
            temperature=call.temperature, invariant=self.invariant,
        )
        return -call.to_batch(log_probs)

    def argmax(self) -> torch.Tensor:
        """The global id of each row's largest logit, [s, b] (every row under sequence parallelism)."""
        call = self._call(None)
        ids = lm_head_ops.lm_head_topk_ids(call.hidden, call.weight, 1, tp_group=call.tp_group,
                               sequence_parallel=call.sequence_parallel,
                               invariant=self.invariant)
        return ids.reshape(call.seq, call.batch)


class _FusedOutputLayer:
    """Stands in for the output layer given to `process_mtp_loss`: called, it returns the hidden
    states as :class:`FusedHeadLogits`; every attribute (`weight`, `sequence_parallel`, ...) is
    the real layer's."""

    def __init__(self, layer: torch.nn.Module, config: Any) -> None:
        self._layer, self._config = layer, config

    def __call__(self, input_: torch.Tensor, weight: torch.Tensor | None = None, **_: Any) -> tuple[Any, None]:
        return FusedHeadLogits(input_, self._layer, weight, self._config), None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._layer, name)


def fused_loss(original: Callable[[torch.Tensor, Any], torch.Tensor]) -> Callable[[torch.Tensor, Any], torch.Tensor]:
    """`compute_language_model_loss` that takes :class:`FusedHeadLogits` through the fused head
    (any other logits to `original`)."""

    def compute_language_model_loss(labels: torch.Tensor, logits: Any) -> torch.Tensor:
        if isinstance(logits, FusedHeadLogits):
            return logits.cross_entropy(labels)
        return original(labels, logits)

    return compute_language_model_loss


def process_mtp_loss_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """`mtp_output_processor`: megatron's `process_mtp_loss` with the fused head standing in for
    the output layer and the loss; a call that does not fit its signature runs unchanged."""
    bound = bind(wrapped, args, kwargs)
    if bound is None or isinstance(bound.arguments["output_layer"], _FusedOutputLayer):
        return wrapped(*args, **kwargs)
    given = bound.arguments
    given["output_layer"] = _FusedOutputLayer(given["output_layer"], given["config"])
    given["compute_language_model_loss"] = fused_loss(given["compute_language_model_loss"])
    if given.get("scale_logits_fn") is not None:  # MuP: folded into the fused head's temperature
        given["scale_logits_fn"] = None
    return wrapped(*bound.args, **bound.kwargs)


def acceptance_counts_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """`mtp_output_processor`: MTP acceptance counts (correct, total) from the fused head's top-1
    ids when the logits are :class:`FusedHeadLogits`; megatron's own otherwise."""
    bound = bind(wrapped, args, kwargs)
    if bound is None or not isinstance(bound.arguments["mtp_logits"], FusedHeadLogits):
        return wrapped(*args, **kwargs)
    given = bound.arguments
    with torch.no_grad():
        preds = given["mtp_logits"].argmax()  # [s, b]
        valid = given["loss_mask"].transpose(0, 1).bool()  # [b, s] => [s, b]
        correct = ((preds == given["mtp_labels"].transpose(0, 1)) & valid).sum().float()
        return correct, valid.sum().float()


def fused_mtp_loss_in_effect(namespace: Mapping[str, Any]) -> bool:
    """Whether `process_mtp_loss` as the module `namespace` (a model module's globals) calls it is
    this patch's active wrapper: its MTP heads then never call the output layer."""
    function = namespace.get("process_mtp_loss")
    if not isinstance(function, wrappers.FunctionWrapper):
        return False
    key = wrappers.patch_key(function)
    return key is not None and key[0] == PATCH_NAME and function.patch_active()
