"""What a step's held segments cannot run yet, decided before a pass begins and agreed over the ranks:
beyond what a plan itself refuses (`refusals`), a model holding segments across micro-batches needs
its whole layer stack in one call (no pipeline stages), its every pass's arithmetic drawn alike (no
dropout), and each of its kinds able to hand a segment's state on (each kind says so in its
`Continuation`: MTP's depths and DSA's indexer do not yet). A refused model plans each
micro-batch on its own (`plan_shared_prefix`), as today."""
from __future__ import annotations

from typing import Any, cast

from megatron_rl_patches.model.chunks import as_chunks
from megatron_rl_patches.model.kinds import is_language_model, qualified_name
from megatron_rl_patches.ops.agreement import gathered_objects, world
from megatron_rl_patches.shared_prefix.kinds import model_kinds
from megatron_rl_patches.shared_prefix.kinds.latent_attention import megatron_core_before_0_16
from megatron_rl_patches.shared_prefix.prepared import own_class

REMEDY = "plan each micro-batch on its own (plan_shared_prefix)"


def config_held_reasons(config: Any, training: bool) -> list[str]:
    """Why a model of `config` cannot hold segments across a step's micro-batches (empty: it can)."""
    reasons = []
    stages = int(getattr(config, "pipeline_model_parallel_size", 1) or 1)
    if stages > 1:
        reasons.append(f"pipeline parallelism (pipeline_model_parallel_size={stages}): a held segment's backward runs "
                       "in its last reader's backward, once its layers' gradients are in, which a pipeline schedule "
                       "spreads over stages and interleaves with other micro-batches' forwards")
    older = megatron_core_before_0_16()
    if training and older is not None and getattr(config, "recompute_granularity", None) == "full":
        reasons.append(f"full activation recompute on megatron-core {older} (before 0.16): its checkpoint's backward "
                       "hands DDP a held segment's parameter gradient twice in one micro-batch (checked on 0.13.1)")
    if getattr(config, "moe_enable_routing_replay", False) and getattr(config, "num_moe_experts", None):
        reasons.append("MoE routing replay (moe_enable_routing_replay): the records are each micro-batch's packed "
                       "rows, which a held segment's readers do not compute")
    if training:
        for name in ("attention_dropout", "hidden_dropout"):
            rate = float(getattr(config, name, 0.0) or 0.0)
            if rate > 0:
                reasons.append(f"dropout in training ({name}={rate}): a held segment is computed again in its "
                               "owner's backward, which would draw other masks")
        if getattr(config, "moe_router_load_balancing_type", None) == "sinkhorn" and getattr(config, "num_moe_experts",
                                                                                                None):
            reasons.append("Sinkhorn load balancing in training (moe_router_load_balancing_type='sinkhorn'): it "
                           "balances each micro-batch's rows together")
    return reasons


def local_held_reasons(model: Any, training: bool) -> list[str]:
    """Why this rank's chunks of `model` cannot hold segments across micro-batches: its config's, and
    each kind's that recognizes one of its modules and cannot hand a segment's state on
    (`Continuation.held_reason`)."""
    reasons: list[str] = []
    named: dict[str, str] = {}  # a kind's reason, with the first module it recognizes
    kinds = [kind for kind in model_kinds() if kind.continuation.held_reason]
    for chunk in as_chunks(model):
        for module in chunk.modules():
            if is_language_model(module):
                reasons += config_held_reasons(module.config, training)
            for kind in kinds:
                reason = str(kind.continuation.held_reason)
                if reason not in named and kind.recognizes(module):
                    named[reason] = f"{reason} ({qualified_name(own_class(type(module)))})"
    return list(dict.fromkeys(reasons)) + list(named.values())


def shared_prefix_step_reason(model: Any, *, training: bool, group: Any = None) -> str | None:
    """Why `model` cannot hold segments across a step's micro-batches on some rank of `group` (None:
    the world), the same answer on every rank; None when every rank can. Call it before the pass's
    first collective, beside `shared_prefix_reason`."""
    gathered = gathered_objects(group if group is not None else world(), local_held_reasons(model, training))
    named = sorted({str(reason) for reasons in gathered for reason in cast(list, reasons or [])})
    return "; ".join(named) if named else None


def check_shared_prefix_step(model: Any, *, training: bool, group: Any = None) -> None:
    """`shared_prefix_step_reason`, raised as a ValueError on every rank when there is one."""
    reason = shared_prefix_step_reason(model, training=training, group=group)
    if reason is not None:
        raise ValueError(f"segments held across a step's micro-batches cannot run this model: {reason}; {REMEDY}")
