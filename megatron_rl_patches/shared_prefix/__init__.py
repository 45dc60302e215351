"""A group's prompt once: shared-prefix packing for every pass of a megatron-core model.

Samples that share leading tokens (a GRPO group's prompt, a multi-turn history, a privileged
context) are found by value and computed once: the physical stream is `[prefix, rest_1, ...,
rest_G]` per group, where every pipeline packs each sample whole. Causal attention makes it exact:
the model's log-probs, entropy, loss and every gradient equal the unshared packed path's. A hand-
written megatron-core loop:

    from megatron_rl_patches.shared_prefix import check_shared_prefix, plan_shared_prefix, \\
        prepare_shared_prefix, shared_prefix_params

    check_shared_prefix(model, training=True)   # before the pass: the same answer on every rank
    prepare_shared_prefix(model)                 # once: the plan's seams on the model
    plan = plan_shared_prefix(tokens, cu_seqlens)  # per micro-batch, from its packed tokens
    output = model(tokens, None, None, labels=labels, packed_seq_params=shared_prefix_params(plan))

The output (logits, an output processor's dict, the loss) is in the logical rows, as without it.
docs/shared-prefix.md says what it saves, when it buys little and what it covers."""
from __future__ import annotations

from megatron_rl_patches import _aliases
from megatron_rl_patches._lazy import lazy_getattr, lazy_names

_LAZY = lazy_names("""
    megatron_rl_patches.shared_prefix.plan: plan_shared_prefix SharedPrefixPlan PlanStats
    megatron_rl_patches.shared_prefix.model_hooks: prepare_shared_prefix shared_prefix_params
    megatron_rl_patches.shared_prefix.refusals: check_shared_prefix shared_prefix_reason
    megatron_rl_patches.shared_prefix.attention: shared_prefix_attention
    megatron_rl_patches.shared_prefix.micro_batches: shared_prefix_micro_batches
    megatron_rl_patches.shared_prefix.repeated_padding: repeated_padding_alike
""")

__all__ = sorted(_LAZY)

__getattr__ = lazy_getattr(__name__, _LAZY, globals())

# `support`: the refusals' module, named for what it holds (issue 113)
_aliases.install(__name__, {"support": "megatron_rl_patches.shared_prefix.refusals"})


def __dir__() -> list[str]:
    return __all__
