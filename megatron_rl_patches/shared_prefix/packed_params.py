"""What a caller passes as `packed_seq_params` to run a shared-prefix plan on a prepared model:
megatron-core's `PackedSeqParams` with the plan, its attention route and its context-parallel layout
(`shared_prefix_params`). Its own module: the kinds' seams build one for a step's side pass (its
held segments alone), and `model_hooks` installs the kinds."""
# lazy imports: optional dependency megatron-core
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch

from megatron_rl_patches.shared_prefix.attention import check_route
from megatron_rl_patches.shared_prefix.context_parallel import WholeRotaryTable, check_logical_layout, computed_count
from megatron_rl_patches.shared_prefix.plan import SharedPrefixPlan

FORMAT = "shared_prefix"  # the qkv_format of a plan's params: a core attention not prepared refuses it


@functools.cache
def params_type() -> type:
    """megatron-core's `PackedSeqParams` with the plan and its attention route."""
    from megatron.core.packed_seq_params import PackedSeqParams

    @dataclasses.dataclass
    class SharedPrefixParams(PackedSeqParams):
        """The `packed_seq_params` of a micro-batch packed by shared prefix."""

        shared_prefix: Any = None
        route: str = "auto"
        cp_layout: str = "zigzag"
        # an MTP depth's stream (shared_prefix/mtp.py): the main plan its output is read back at
        main_plan: Any = None

    return SharedPrefixParams


def shared_prefix_params(plan: SharedPrefixPlan, route: str = "auto", cp_layout: str = "zigzag") -> Any:
    """What a caller passes as `packed_seq_params` to run `plan` on a prepared model: megatron-core's
    `PackedSeqParams` (qkv_format "shared_prefix", the rotary table's length in max_seqlen) holding the
    plan; `route` the attention's ("auto": FlexAttention on CUDA, the mask route elsewhere). Its
    cu_seqlens span the stream as one sequence: megatron-core 0.13-0.15 read any packed params as
    `thd` (the batch dimension squeezed, RoPE per sequence of cu_seqlens), and one sequence takes the
    table the attention hook already read at each token's position, whole. Under context parallelism
    every rank passes the same plan (of the whole micro-batch) and its own share of the ids, cut in
    `cp_layout` ("zigzag": megatron-core's per sequence; "contiguous": slime's --allgather-cp), and
    gets its logits back at those rows (`context_parallel`)."""
    if not isinstance(plan, SharedPrefixPlan):
        raise TypeError(f"shared_prefix_params: plan must be a SharedPrefixPlan, got {type(plan).__name__}")
    # one sequence of the rows the model computes (a step's held segments are not among them)
    whole = torch.tensor([0, computed_count(plan)], dtype=torch.int32)
    # the table also covers the padding as packed (one sequence): an MTP depth's stream runs it so
    longest = max(plan.longest, plan.logical_length - plan.stats.logical_tokens)
    cls = params_type()
    # megatron-core 0.16+ hands the rotary embedding this group: the table stays whole under a plan
    whole_table = {"cp_group": WholeRotaryTable()} if "cp_group" in {f.name for f in dataclasses.fields(cls)} else {}
    return cls(qkv_format=FORMAT, cu_seqlens_q=whole, cu_seqlens_kv=whole, max_seqlen_q=longest,
               max_seqlen_kv=longest, shared_prefix=plan, route=check_route(route),
               cp_layout=check_logical_layout(cp_layout), **whole_table)
