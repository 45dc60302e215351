"""Attention layers: megatron-core's `Attention` (self-attention, the gated kind too), its multi-latent
attention and 0.19's absorbed MLA (DSA's). Each runs its own forward under a plan and hands
`packed_seq_params` on to its core; the seam is the rotary table the model built, read at each
token's own position (`rotary_at_positions`, a forward pre-hook). Cross attention is refused by
name; so is a planned call whose core attention no kind prepared (a core no kind knows, noted
when the model is prepared: `check_shared_prefix` names it before the pass), which would otherwise
run its own arithmetic over the plan's stream."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from megatron_rl_patches.model.arguments import ArgumentsByName
from megatron_rl_patches.model.kinds import qualified_name
from megatron_rl_patches.shared_prefix.context_parallel import module_share, taken
from megatron_rl_patches.shared_prefix.kinds.kind import ByCode, ModelKind
from megatron_rl_patches.shared_prefix.plan import shared_prefix_plan_of
from megatron_rl_patches.shared_prefix.prepared import Prepared, own_class

UNKNOWN_CORE = "_megatron_rl_patches_shared_prefix_unknown_core"  # an attention layer's core no kind prepared


def note_unknown_core(module: Any, kinds: Iterable[ModelKind]) -> None:
    """Mark an attention layer whose core none of `kinds` recognizes (named by its class), which its
    planned calls then refuse: no kind prepared that core."""
    core = getattr(module, "core_attention", None)
    if core is None or isinstance(core, Prepared) or not ATTENTION_LAYERS.recognizes(module):
        return
    if not any(kind.recognizes(core) for kind in kinds):
        setattr(module, UNKNOWN_CORE, qualified_name(own_class(type(core))))


def rotary_at_positions(module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """Forward pre-hook of an attention layer: the rotary table at each physical row's position."""
    call = ArgumentsByName.of_forward(module, args, kwargs)
    params = call.get("packed_seq_params")
    plan = shared_prefix_plan_of(params)
    if plan is None:
        return None
    unknown = getattr(module, UNKNOWN_CORE, None)
    if unknown is not None:
        raise ValueError(f"shared prefix: the core attention {unknown} of {type(module).__name__} is not one the plan "
                         "knows: prepare_shared_prefix left it as it is, and it would run its own arithmetic over the "
                         "plan's stream (check_shared_prefix names why before the pass); do not pack this model's "
                         "micro-batches by shared prefix")
    table = call.get("rotary_pos_emb")
    if table is None:
        return None
    held = module_share(module, plan, params)

    def at_positions(emb: Any) -> Any:
        if emb is None:
            return None
        if emb.size(0) < plan.longest:
            raise ValueError(f"shared prefix: the model's rotary table has {emb.size(0)} rows, the plan's longest "
                             f"sample {plan.longest}")
        if held is not None:
            return emb.index_select(0, taken(plan, held[0], "positions", "physical", emb.device))
        return emb.index_select(0, plan.on(emb.device, "positions"))

    call.set("rotary_pos_emb", tuple(at_positions(e) for e in table) if isinstance(table, tuple)
             else at_positions(table))
    return call.done()


class AttentionLayers(ByCode):
    def reason(self, module: Any, path: str) -> str | None:
        kind = getattr(module, "attention_type", "self")
        return None if kind == "self" else f"{kind} attention ({qualified_name(type(module))} at {path})"

    def prepare(self, module: Any) -> bool:
        module.register_forward_pre_hook(rotary_at_positions, with_kwargs=True)
        return True


ATTENTION_LAYERS = AttentionLayers("attention layer", classes=(
    "megatron.core.transformer.attention:Attention",
    "megatron.core.transformer.multi_latent_attention:MultiLatentAttention",
    "megatron.core.transformer.experimental_attention_variant.absorbed_mla:AbsorbedMLASelfAttention"))
