"""Multi-latent attention (megatron-core's `MLASelfAttention`: DeepSeek-V3's, Kimi-K2's,
GLM-4.7-Flash's) under a shared-prefix plan.

MLA owns its rotary embedding (`rotary_pos_emb`, plain RoPE or YaRN) and builds it inside
`get_query_key_value_tensors` from a length alone: the model's table never reaches it, so the
attention pre-hook that reads the model's table at each token's position has nothing to read. The
seam is the length: MLA asks its rotary module for it (`get_rotary_seq_len`, handed the call's
`packed_seq_params`), then asks it for the table of that length. Under a plan the length comes
back as a `PlannedLength` (an int: the stream's rows) that carries the plan, and the table asked
for with it is the one of the longest sample read at each physical row's own position, one row per
row of the stream (the whole stream is one sequence: megatron-core takes the table's first rows,
as many as the stream has, and rotates row i by table row i). The plan travels with the call's
arguments, never in module state; a call without a plan runs the module's own methods.

Under context parallelism each rank holds its share of the physical stream: the table comes back
one row per row of that share, each at its own row's position, and the rotary module is asked for
the whole table (its own `cp_group` would cut it per rank as for an unpacked sequence). The
queries, keys and values (narrower than the keys) then reach the plan's core attention, which
gathers keys and values over the ranks (`context_parallel`).

Refused by name under a plan: the fused MLA RoPE (`apply_rope_fusion`: its kernel takes each
token's position from cu_seqlens), interleaved rotary halves, and what of DSA's sparse attention
`sparse_attention_refusal` refuses."""
# lazy imports: optional dependency megatron-core
from __future__ import annotations

import functools
import inspect
from typing import Any

from megatron_rl_patches.model.arguments import ArgumentsByName
from megatron_rl_patches.shared_prefix.context_parallel import Share, WholeRotaryTable, group_share, taken
from megatron_rl_patches.shared_prefix.plan import SharedPrefixPlan, shared_prefix_plan_of
from megatron_rl_patches.shared_prefix.prepared import Prepared
from megatron_rl_patches.shared_prefix.sparse_attention_refusal import refusal as sparse_refusal

WHOLE_TABLE = WholeRotaryTable()  # one instance: the rotary module's cache keys on its arguments


class PlannedLength(int):
    """The rotary length MLA asks for under a plan: the rows this rank runs (the stream's, or its
    context-parallel `share`'s), with the plan."""

    plan: SharedPrefixPlan
    share: Share | None

    def __new__(cls, plan: SharedPrefixPlan, share: Share | None) -> PlannedLength:
        length = super().__new__(cls, plan.physical_length if share is None else int(share.physical.numel()))
        length.plan, length.share = plan, share
        return length


def is_latent_attention(module: Any) -> bool:
    """megatron-core's multi-latent attention: its own rotary module and latent projections."""
    config = getattr(module, "config", None)
    return (bool(getattr(config, "multi_latent_attention", False)) and hasattr(module, "rotary_pos_emb")
            and hasattr(module, "get_query_key_value_tensors"))


def prepare_latent_attention(attention: Any) -> None:
    """Make `attention`'s rotary module answer a plan's call with the table at the plan's positions."""
    rotary = attention.rotary_pos_emb
    if not isinstance(rotary, PlannedRotary):
        rotary.__class__ = planned_rotary_class(rotary.__class__)


def refusal(config: Any) -> str | None:
    """What of this MLA config a plan cannot run, or None."""
    if getattr(config, "experimental_attention_variant", None) == "dsa":
        refused = sparse_refusal(config, training=False)  # the indexer loss: refused by the DSA core, which knows
        if refused is not None:
            return refused
    if getattr(config, "apply_rope_fusion", False):
        return "multi-latent attention with apply_rope_fusion (the fused kernel takes positions from cu_seqlens)"
    if getattr(config, "rotary_interleaved", False):
        return "multi-latent attention with rotary_interleaved"
    return None


class PlannedRotary(Prepared):
    """The mark of a rotary module whose class `planned_rotary_class` made."""


def _at_positions(table: Any, length: PlannedLength) -> Any:
    """[longest, 1, 1, d] -> [rows, 1, d]: row i at this rank's physical row i's position
    (megatron-core squeezed the packed batch of MLA's queries and keys, [rows, heads, d])."""
    plan, share = length.plan, length.share
    positions = (plan.on(table.device, "positions") if share is None
                 else taken(plan, share, "positions", "physical", table.device))
    return table.index_select(0, positions).squeeze(1)


def _share(rotary: Any, config: Any, plan: SharedPrefixPlan, params: Any) -> Share | None:
    """This rank's context-parallel share of the plan (None: it runs the whole stream)."""
    group = None
    if int(getattr(config, "context_parallel_size", 1) or 1) > 1:
        group = getattr(rotary, "cp_group", None)
        if group is None:
            from megatron.core import parallel_state  # lazy: optional dependency megatron-core

            group = parallel_state.get_context_parallel_group()
    held = group_share(group, plan, params)
    return None if held is None else held[0]


@functools.cache
def _takes_cp_group(cls: Any) -> bool:
    try:
        return "cp_group" in inspect.signature(cls.forward).parameters
    except (TypeError, ValueError):
        return False


@functools.cache
def planned_rotary_class(cls: Any) -> type:
    """`cls` (MLA's RotaryEmbedding / YarnRotaryEmbedding) taking a plan's length."""

    def get_rotary_seq_len(self: Any, *args: Any, **kwargs: Any) -> Any:
        call = ArgumentsByName(cls.get_rotary_seq_len, args, kwargs, method=True)
        plan = shared_prefix_plan_of(call.get("packed_seq_params"))
        if plan is None:
            return cls.get_rotary_seq_len(self, *args, **kwargs)
        config = call.get("transformer_config")
        refused = refusal(config)
        if refused is not None:
            raise ValueError(f"shared prefix: {refused} is not taken with a shared-prefix plan")
        return PlannedLength(plan, _share(self, config, plan, call.get("packed_seq_params")))

    def forward(self: Any, max_seq_len: Any, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(max_seq_len, PlannedLength):
            return cls.forward(self, max_seq_len, *args, **kwargs)
        plan = max_seq_len.plan
        if _takes_cp_group(cls):  # megatron-core 0.16+: the whole table, never one rank's cut of it
            kwargs["cp_group"] = WHOLE_TABLE
        # a plain int: the class's own forward keeps its cache per length
        made = cls.forward(self, plan.longest, *args, **kwargs)
        if isinstance(made, tuple):  # YaRN: (table, mscale)
            return (_at_positions(made[0], max_seq_len), *made[1:])
        return _at_positions(made, max_seq_len)

    return type(f"SharedPrefix{cls.__name__}", (cls, PlannedRotary),
                {"get_rotary_seq_len": get_rotary_seq_len, "forward": forward, "__module__": cls.__module__,
                 "__doc__": cls.__doc__})
