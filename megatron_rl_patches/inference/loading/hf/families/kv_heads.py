"""Key/value heads at a tensor-parallel size: megatron-core splits its query groups over the
ranks and never repeats them, so a model with fewer key/value heads G than the tensor-parallel
size tp is built with tp query groups, each of the checkpoint's key/value heads repeated r = tp / G
times (group g uses head g // r). Exact: with H query heads, HF's query head h attends with key/value
head h // (H / G); in megatron's build it falls in group h // (H / tp), whose head is
(h // (H / tp)) // r = h // (H / G). Served where tp is a multiple of G and divides H; each rank then
holds one group and reads only its one key/value head. No torch here (the memory planner reads it)."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron_rl_patches.inference.loading.hf.architecture import HFArchitecture


def kv_repeat(arch: HFArchitecture, tp: int) -> int:
    """How many times each key/value head is repeated at tensor-parallel size `tp` (1: not repeated)."""
    groups = arch.num_kv_heads
    if tp > groups and not tp % groups and not arch.num_heads % tp:
        return tp // groups
    return 1


def query_groups(arch: HFArchitecture, tp: int) -> int:
    """The query groups megatron-core is built with at `tp` (the checkpoint's key/value heads, repeated)."""
    return arch.num_kv_heads * kv_repeat(arch, tp)


def kv_head_problems(arch: HFArchitecture, tp: int) -> list[str]:
    """Why `tp` cannot split `arch`'s key/value heads (neither divides them nor repeats them)."""
    groups, heads = arch.num_kv_heads, arch.num_heads
    if not groups % tp or kv_repeat(arch, tp) > 1:
        return []
    if tp % groups:
        return [f"num_key_value_heads={groups} is not a multiple of the tensor-parallel size {tp} (nor a divisor of "
                f"it: key/value heads are repeated where tp is a multiple of them)"]
    return [f"num_attention_heads={heads} is not a multiple of the tensor-parallel size {tp} (its "
            f"num_key_value_heads={groups} would be repeated {tp // groups} times, but each rank needs whole "
            "query heads)"]
