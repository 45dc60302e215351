"""What megatron-core still does in parallel_state's groups in a model built on its own
ProcessGroupCollection, turned to the model's groups after a build at a teacher layout.

Multi-latent attention (checked on megatron-core 0.16.1 and 0.19.2): MLASelfAttention builds its
query and key/value down projections as column-parallel linears in the collection's
tensor-parallel group, then gathers their split outputs with
`gather_from_tensor_model_parallel_region(x)` and no group, which is parallel_state's (the
student's: size 1 beside a TP=1 student, so nothing is gathered and the widths do not add up).
Each such linear is made to gather its own output in its own group (ColumnParallelLinear's
`gather_output`, over its `tp_group`): MLA then sees the whole widths and gathers nothing itself.
The weights stay split (each rank holds 1/tp of them); the sums are the same."""
from __future__ import annotations

from typing import Any

# MLASelfAttention's down projections whose split outputs megatron-core gathers in parallel_state's group
_MLA_DOWN = ("linear_q_down_proj", "linear_kv_down_proj")


def gather_in_own_groups(chunks: list[Any]) -> int:
    """Make every multi-latent attention down projection of `chunks` gather its output in its own
    tensor-parallel group; the number of projections changed. ValueError naming a fused down
    projection (`linear_qkv_down_proj`, megatron-core 0.19's), which this does not serve."""
    from megatron.core.tensor_parallel import ColumnParallelLinear  # lazy: optional dependency megatron-core
    from megatron.core.transformer.multi_latent_attention import (  # lazy: optional dependency megatron-core
        MultiLatentAttention,
    )

    changed = 0
    for chunk in chunks:
        for name, module in chunk.named_modules():
            if not isinstance(module, MultiLatentAttention):
                continue
            if getattr(module, "linear_qkv_down_proj", None) is not None:
                raise ValueError(f"{name}: a fused multi-latent down projection (linear_qkv_down_proj) gathers in "
                                 "parallel_state's group; it is not served at a teacher's own layout")
            for attribute in _MLA_DOWN:
                linear = getattr(module, attribute, None)
                if isinstance(linear, ColumnParallelLinear) and not linear.gather_output:
                    linear.gather_output = True
                    changed += 1
    return changed
