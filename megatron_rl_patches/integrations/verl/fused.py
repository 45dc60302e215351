"""verl (0.9.x): its Megatron engine's fused log-prob route and its top-k distillation loss.

- `verl_fused_logprobs`: verl's `fused_output_processor` (a Triton kernel that asserts CUDA) is
  replaced by our fused LM-head processor behind verl's own contract: the scalar temperature of
  `FusedOutputProcessorContext`, verl's `CausalLMOutputForPPO` with `.log_probs` / `.entropy` as
  flat [s*b] tensors, the output weight read only after the output layer's forward pre-hooks ran
  (overlap-param-gather), entropy (and its gradient) only when verl's engine asks
  (`calculate_entropy`). verl's `fused_forward_model_engine` factory is wrapped to pass that flag
  down and to undo a "legacy" fused mode cached on a model before the patch was active. Only the
  rows verl reads (its responses, its loss mask) meet the output weight: see `rows`.
- `verl_topk_kd`: `compute_forward_kl_topk` of verl's Megatron losses, where verl looks it up at
  call time (`verl/trainer/distillation/losses.py::compute_topk_loss`), becomes the exact
  (k+1)-bucket forward KL; see `topk`.

verl's `register_megatron_training_hooks` is not patched: in verl 0.9.1 the only caller is
`MegatronEngine._build_optimizer`, once per engine, so no real path calls it twice.
Every record is a no-op until verl's module is imported (post-import hooks).
"""
# lazy imports: optional dependency verl
from __future__ import annotations

import contextvars
import functools
import inspect
import sys
from typing import Any

import torch

from megatron_rl_patches.integrations.verl.rows import packed_row_mask
from megatron_rl_patches.processors.heads import log_prob_output_processor

FUSED = "verl.models.mcore.model_forward_fused"

# Whether verl's engine asked for entropy in the current fused forward (None: called outside it).
# Not an argument: verl's model forward calls fused_output_processor with its fixed keywords (no calculate_entropy).
_CALCULATE_ENTROPY: contextvars.ContextVar[bool | None] = contextvars.ContextVar(
    "megatron_rl_patches_verl_entropy", default=None
)


def _scalar_temperature(context: Any) -> float:
    value = getattr(context, "temperature", None)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(
            "verl_fused_logprobs: output_processor_context must be verl's FusedOutputProcessorContext with a "
            f"float temperature > 0 (verl's _resolve_fused_temperature gives one), got {context!r}"
        )
    return float(value)


def _flat(rows: Any) -> Any:
    """[b, s] back to verl's kernel layout: the hidden states' [s, b] order, flattened."""
    return None if rows is None else rows.transpose(0, 1).reshape(-1)


def fused_output_processor(*, hidden_states: Any, output_layer: Any, output_weight: Any = None, labels: Any = None,
                           context: Any = None, config: Any = None, **_ignored: Any) -> Any:
    """verl's `fused_output_processor` contract on `log_prob_output_processor`: returns verl's
    `CausalLMOutputForPPO` with `.log_probs` and `.entropy` ([s*b], as verl's kernel gives)."""
    from verl.utils.model import CausalLMOutputForPPO


    asked = _CALCULATE_ENTROPY.get()
    with_entropy = True if asked is None else asked  # outside the engine: as verl, always entropy
    process = log_prob_output_processor(
        temperature=_scalar_temperature(context),
        with_entropy=with_entropy,
        entropy_requires_grad=with_entropy and torch.is_grad_enabled(),
    )
    rows = packed_row_mask(labels)  # the rows verl reads, in a noted forward_step (`rows`)
    result = process(hidden_states=hidden_states, output_layer=output_layer, output_weight=output_weight,
                     labels=labels, config=config, context=None if rows is None else {"row_mask": rows})
    output = CausalLMOutputForPPO(loss=None, logits=None, past_key_values=None, hidden_states=hidden_states,
                                  attentions=None)
    output.log_probs = _flat(result["log_probs"])
    output.entropy = _flat(result["entropy"])
    return output


def fused_output_processor_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper for `verl_fused_logprobs` on verl's processor (keyword-only in verl 0.9.1)."""
    if args or not all(name in kwargs for name in ("hidden_states", "output_layer")):
        return wrapped(*args, **kwargs)  # not megatron's call: verl's own error or behaviour
    return fused_output_processor(**kwargs)


def _drop_stale_legacy_mode(model: Any) -> None:
    """verl 0.9.1's `patch_fused_forward` caches "legacy" on a model (and swaps in its own
    forward) when GPTModel.forward lacked the hook at engine build, i.e. on megatron-core < 0.18
    with `gpt_output_processor` applied later. Once the hook is there, drop verl's forward swap
    and cache "hook", so the fused route goes through the (patched) output processor."""
    fused = sys.modules.get(FUSED)
    names = ("_get_patching_model", "_FUSED_FORWARD_MODE_ATTR", "_LEGACY_MODE", "_HOOK_MODE")
    if fused is None or not all(hasattr(fused, name) for name in names):
        return  # another verl layout: nothing cached that we know of
    target = fused._get_patching_model(model)
    if target is None or getattr(target, fused._FUSED_FORWARD_MODE_ATTR, None) != fused._LEGACY_MODE:
        return
    class_forward = type(target).forward.__get__(target, type(target))
    if not {"output_processor", "output_processor_context"} <= set(inspect.signature(class_forward).parameters):
        return
    # verl's own unpatch_fused_forward would put back `forward_backup`, the bound method taken
    # before the patch (megatron's bare forward as an instance attribute); drop both instance
    # attributes instead, so the class's (wrapped) forward serves the model again.
    for name in ("forward", "forward_backup"):
        target.__dict__.pop(name, None)
    setattr(target, fused._FUSED_FORWARD_MODE_ATTR, fused._HOOK_MODE)


def fused_engine_factory_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper for `verl_fused_logprobs` on `fused_forward_model_engine(vision_model)`: the
    returned forward tells the processor whether verl asked for entropy, after dropping a stale mode."""
    inner = wrapped(*args, **kwargs)
    signature = inspect.signature(inner)

    @functools.wraps(inner)
    def fused_forward_model_engine_inner(*call_args: Any, **call_kwargs: Any) -> Any:
        try:
            bound = signature.bind(*call_args, **call_kwargs)
        except TypeError:
            return inner(*call_args, **call_kwargs)  # verl's own error message
        _drop_stale_legacy_mode(bound.arguments["model"])
        token = _CALCULATE_ENTROPY.set(bool(bound.arguments.get("calculate_entropy", True)))
        try:
            return inner(*call_args, **call_kwargs)
        finally:
            _CALCULATE_ENTROPY.reset(token)

    return fused_forward_model_engine_inner
