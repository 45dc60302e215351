"""What a shared-prefix plan can run on, decided before a pass begins and agreed over the ranks.

A remainder must start from what its prefix left behind, and a statistic over tokens must count a
prefix token once per sample that shares it. Where neither holds, the combination is refused by
name: context parallelism, multi-latent attention (its rotary table is its own), multi-token
prediction, recurrent layers (Qwen3.5's gated delta net, Mamba), the multimodal rotary embedding,
MoE token dropping, and, in training, MoE load-balancing statistics (auxiliary loss, z-loss, expert
bias, Sinkhorn routing). A pipeline needs megatron-core's `variable_seq_lengths` (each micro-batch's
physical length is its own). The layer kinds differ between pipeline stages, so the reasons are
agreed over the group before anything else: one rank's reason is every rank's."""
from __future__ import annotations

from typing import Any

from megatron_rl_patches.ops.agreement import gathered_objects, world
from megatron_rl_patches.shared_prefix.model_hooks import is_attention, is_language_model, modules_of

RECURRENT = {"GatedDeltaNet": "Qwen3.5's gated delta net layers (each remainder would start from the prefix's final "
                              "recurrent state)",
             "MambaMixer": "Mamba layers (each remainder would start from the prefix's final state)"}


def _positive(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return any(_positive(v) for v in value)
    return value is not None and float(value) > 0


def config_reason(config: Any, training: bool) -> str | None:
    """Why a model of `config` cannot run a plan (`training`: with gradients), or None."""
    cp = int(getattr(config, "context_parallel_size", 1) or 1)
    if cp > 1:
        return f"context parallelism (context_parallel_size={cp})"
    if getattr(config, "multi_latent_attention", False):
        return "multi-latent attention (its rotary embedding is computed inside the layer)"
    if getattr(config, "mtp_num_layers", None):
        return f"multi-token prediction (mtp_num_layers={config.mtp_num_layers})"
    pp = int(getattr(config, "pipeline_model_parallel_size", 1) or 1)
    if pp > 1 and not getattr(config, "variable_seq_lengths", False):
        return ("pipeline parallelism without variable_seq_lengths (a planned micro-batch's length is its own; "
                "set config.variable_seq_lengths=True)")
    if getattr(config, "num_moe_experts", None):
        if getattr(config, "moe_expert_capacity_factor", None) is not None:
            return (f"MoE token dropping (moe_expert_capacity_factor={config.moe_expert_capacity_factor}: "
                    "which tokens drop depends on the batch)")
        if training:
            balancing = getattr(config, "moe_router_load_balancing_type", "aux_loss")
            if balancing == "sinkhorn":
                return "MoE Sinkhorn routing in training (it balances over the batch's tokens)"
            if balancing != "none" and _positive(getattr(config, "moe_aux_loss_coeff", 0.0)):
                return (f"MoE load balancing in training (moe_aux_loss_coeff={config.moe_aux_loss_coeff}: its "
                        "statistics would count a shared prefix token once, not once per sample); set it to 0")
            if _positive(getattr(config, "moe_z_loss_coeff", None)):
                return (f"MoE z-loss in training (moe_z_loss_coeff={config.moe_z_loss_coeff}: it would count a "
                        "shared prefix token once, not once per sample)")
            if getattr(config, "moe_router_enable_expert_bias", False):
                return "MoE expert bias in training (moe_router_enable_expert_bias: its token counts would differ)"
    return None


def local_reason(model: Any, training: bool) -> str | None:
    """Why this rank's chunks of `model` cannot run a plan, or None."""
    found = False
    for module in modules_of(model):
        name = type(module).__name__
        for kind, reason in RECURRENT.items():
            if kind in name:
                return reason
        if is_language_model(module):
            found = True
            embedding = getattr(module, "position_embedding_type", "rope")
            if embedding == "mrope":
                return "the multimodal rotary embedding (position_embedding_type mrope)"
            refused = config_reason(module.config, training)
            if refused is not None:
                return refused
        elif is_attention(module) and getattr(module, "attention_type", "self") != "self":
            return f"{getattr(module, 'attention_type', '')} attention"
    if not found:
        return "no megatron-core language model (GPTModel, HybridModel) in the model chunks"
    return None


def shared_prefix_reason(model: Any, *, training: bool, group: Any = None) -> str | None:
    """Why `model` cannot run a shared-prefix plan on some rank of `group` (None: the world when
    torch.distributed is initialized), the same answer on every rank; None when every rank can.
    Call it before the pass's first collective."""
    reasons = gathered_objects(group if group is not None else world(), local_reason(model, training))
    named = sorted({str(reason) for reason in reasons if reason})
    return "; ".join(named) if named else None


def check_shared_prefix(model: Any, *, training: bool, group: Any = None) -> None:
    """`shared_prefix_reason`, raised as a ValueError on every rank when there is one."""
    reason = shared_prefix_reason(model, training=training, group=group)
    if reason is not None:
        raise ValueError(f"shared-prefix packing cannot run this model: {reason}. Set "
                         "MEGATRON_RL_PATCHES_SHARED_PREFIX=0 (or do not plan its micro-batches)")
