"""megatron-core's DeepSeek sparse attention (DSA: `experimental_attention_variant='dsa'`, its
`DSAttention` core with a `DSAIndexer`, inside `AbsorbedMLASelfAttention`; GLM-5's and
DeepSeek-V3.2's) under a shared-prefix plan, on megatron-core 0.19 and later.

The indexer scores each (query, key) pair from the two tokens' own hidden states, its rotary part at
each token's own position; each query keeps the top-k of the keys it may see and attends only those.
Under a plan a row may see exactly its ancestors' rows and its own, earlier ones
(`attention_rule.sees`): handed that rule as the attention mask, megatron-core's own code scores,
selects and attends the same keys for each logical row as the same samples packed whole do. Two
seams: the indexer's rotary module answers a plan's length with the table at each row's position
(as MLA's does, `mla.planned_rotary_class`, kept 4-D: the indexer rotates [rows, 1, heads, d]), and
the core's forward takes the plan's rule as its mask (`attn_mask_type=None`, a boolean mask, True
where a row may not look), which megatron-core's torch path applies before the top-k, in the sparse
attention and in the indexer loss. A call without a plan runs the module's own forward.

Where top-k scores tie (the ReLU scoring's zeros, `dsa_indexer_scoring_relu`), megatron-core's
`torch.topk` picks among the tied keys by their place in the stream: the same samples packed at
other offsets already differ there, and a plan's stream is one more such packing.

Refused by name under a plan (`sparse_attention_refusal`): megatron-core before 0.19 (its
DSAttention refuses packed input: `assert packed_seq_params is None` in
`DSAIndexer.forward_with_scores`), the fused kernels (`dsa_kernel_backend` other than 'none': they
take one contiguous key range per query), the indexer loss in training (`dsa_indexer_loss_coeff` >
0: megatron-core averages its KL over the stream's query rows, so a shared prefix row would count
once instead of once per sample that holds it), top-k shared across layers (`dsa_indexer_topk_freq`
> 1, not tested), the indexer's interleaved RoPE, context parallelism (its key gather and masks
follow megatron-core's own layouts, not the plan's share) and float64 (megatron-core's masked path
builds a float32 mask and asserts it matches the scores' dtype)."""
# lazy imports: optional dependency megatron-core
from __future__ import annotations

import functools
from typing import Any

import torch

from megatron_rl_patches.model.arguments import ArgumentsByName
from megatron_rl_patches.model.kinds import qualified_name
from megatron_rl_patches.shared_prefix.attention_rule import dense
from megatron_rl_patches.shared_prefix.mla import PlannedLength, planned_rotary_class
from megatron_rl_patches.shared_prefix.plan import SharedPrefixPlan, shared_prefix_plan_of
from megatron_rl_patches.shared_prefix.prepared import Prepared
from megatron_rl_patches.shared_prefix.sparse_attention_refusal import megatron_core_before_0_19, refusal


def module_reason(module: Any, path: str) -> str | None:
    """Why a model holding this DSA core (at `path`) cannot run a plan on this megatron-core, or None."""
    old = megatron_core_before_0_19()
    if old is None:
        return None
    return (f"DSA sparse attention on megatron-core {old} ({qualified_name(type(module))} at {path}): its DSAttention "
            "refuses packed input (DSAIndexer.forward_with_scores asserts packed_seq_params is None); the plan runs "
            "megatron-core 0.19's; upgrade megatron-core or do not share this model's prefixes")


def prepare_sparse_attention(core: Any) -> None:
    """Make `core` (a DSAttention) take a plan's rule as its mask, and its indexer's rotary module answer a
    plan's length with the table at the plan's positions."""
    if not isinstance(core, PlannedSparseAttention):
        core.__class__ = planned_sparse_attention_class(core.__class__)
    indexer = getattr(core, "indexer", None)
    rotary = getattr(indexer, "rotary_pos_emb", None)
    if rotary is not None and not isinstance(rotary, IndexerRotary):
        rotary.__class__ = indexer_rotary_class(rotary.__class__)


class PlannedSparseAttention(Prepared):
    """The mark of a DSA core whose class `planned_sparse_attention_class` made."""


class IndexerRotary(Prepared):
    """The mark of an indexer rotary module whose class `indexer_rotary_class` made."""


def hidden_keys(plan: SharedPrefixPlan, device: Any) -> torch.Tensor:
    """[1, 1, rows, rows] bool: True where the plan's rule hides a key from a row (megatron-core's mask)."""
    return plan.cached(("dsa hidden keys", str(device)),
                       lambda: ~dense(plan.physical_length, plan.on(device, "reach"))[None, None])


@functools.cache
def planned_sparse_attention_class(cls: Any) -> type:
    """`cls` (megatron-core's DSAttention) taking a plan's rule as its attention mask."""

    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        call = ArgumentsByName(cls.forward, args, kwargs, method=True)
        plan = shared_prefix_plan_of(call.get("packed_seq_params"))
        if plan is None:
            return cls.forward(self, *args, **kwargs)
        refused = refusal(self.config, self.training and torch.is_grad_enabled())
        if refused is not None:
            raise ValueError(f"shared prefix: {refused} is not taken with a shared-prefix plan")
        if call.get("attention_bias") is not None:
            raise ValueError("shared prefix: an attention bias is not taken with a shared-prefix plan")
        call.set("attention_mask", hidden_keys(plan, call.get("query").device))
        call.set("attn_mask_type", None)
        planned_args, planned_kwargs = call.done()
        return cls.forward(self, *planned_args, **planned_kwargs)

    return type(f"SharedPrefix{cls.__name__}", (cls, PlannedSparseAttention),
                {"forward": forward, "__module__": cls.__module__, "__doc__": cls.__doc__})


@functools.cache
def indexer_rotary_class(cls: Any) -> type:
    """`cls` (the indexer's RotaryEmbedding / YarnRotaryEmbedding) answering a plan's length with the table
    at each row's position, [rows, 1, 1, d] (the indexer rotates [rows, batch 1, heads, d])."""
    planned: Any = planned_rotary_class(cls)

    def forward(self: Any, max_seq_len: Any, *args: Any, **kwargs: Any) -> Any:
        made = planned.forward(self, max_seq_len, *args, **kwargs)
        if not isinstance(max_seq_len, PlannedLength):
            return made
        if isinstance(made, tuple):  # YaRN: (table, mscale)
            return (made[0].unsqueeze(1), *made[1:])
        return made.unsqueeze(1)

    return type(f"SharedPrefixIndexer{cls.__name__}", (planned, IndexerRotary),
                {"forward": forward, "__module__": cls.__module__, "__doc__": cls.__doc__})
