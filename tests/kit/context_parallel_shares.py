"""A layer's own context-parallel share of a sharing plan (`shared_prefix.context_parallel`'s
`context_parallel_group` and `group_share`, the seam slime's gated delta net layers read at CP > 1),
checked inside test_context_parallel_layouts.py's 4-rank world at CP = 2 x TP = 2 with no model: the
group a module runs over (its `pg_collection`'s CP group where it has one, else megatron-core's, none
at a context-parallel size of 1), each rank's share of the plan in the layout its ids were cut in,
and ranks handed different layouts told so alike before any of them reads a row."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any


def share_checks() -> dict[str, Any]:
    """What this rank's checks found (the test compares them with what each rank should find)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from kit.shared_prefix import grpo_batch
    from megatron_rl_patches.shared_prefix.context_parallel import (
        context_parallel_group,
        gathered_logical_order,
        gathered_stream,
        group_share,
        share_of,
        taken,
    )
    from megatron_rl_patches.testing.megatron_cpu import megatron_on_cpu

    found: dict[str, Any] = {}
    with megatron_on_cpu(tensor_parallel=2, context_parallel=2):
        cp = parallel_state.get_context_parallel_group()

        def module(size: int, collection: Any = None) -> Any:
            return SimpleNamespace(config=SimpleNamespace(context_parallel_size=size), pg_collection=collection)

        def ranks(group: Any) -> Any:
            return None if group is None else dist.get_process_group_ranks(group)

        found["cp ranks"] = ranks(cp)
        found["its own group"] = ranks(context_parallel_group(module(2, SimpleNamespace(cp=dist.group.WORLD))))
        found["megatron's group"] = ranks(context_parallel_group(module(2)))
        found["one rank"] = ranks(context_parallel_group(module(1)))
        def plan() -> Any:  # a new plan each time: one agrees its layout once, then keeps the answer
            return grpo_batch(((33, (3, 7)), (21, (3, 7, 11))), (), padding=8, seed=1).plan(pad_to=4)

        for layout in ("zigzag", "contiguous"):
            share, group = group_share(cp, plan(), SimpleNamespace(cp_layout=layout))
            found[layout] = (share.size, share.rank, share.layout, share.logical.tolist(), ranks(group))
        found["no group"] = group_share(None, plan(), SimpleNamespace(cp_layout="zigzag"))
        # the stream gathered from every rank's physical rows, the gradient summed back to its own rows
        whole_plan, me = plan(), dist.get_rank(cp)
        share = share_of(whole_plan, 2, me, "zigzag")
        local = whole_plan.tokens[share.physical].double()[:, None].requires_grad_()
        whole = gathered_stream(local, whole_plan, share, cp)
        weights = torch.arange(whole_plan.physical_length, dtype=torch.float64)[:, None]
        (whole * weights * (me + 1)).sum().backward()  # rank r's loss weighs the stream r + 1 times
        found["gathered"] = (torch.equal(whole.detach()[:, 0], whole_plan.tokens.double()),
                             torch.equal(local.grad, 3 * weights[share.physical]))
        found["positions taken"] = torch.equal(taken(whole_plan, share, "positions", "physical", "cpu"),
                                               whole_plan.positions[share.physical])
        for layout in ("zigzag", "contiguous"):  # one plan, each layout's own order
            order = gathered_logical_order(whole_plan, share_of(whole_plan, 2, me, layout), "cpu")
            every = torch.cat([share_of(whole_plan, 2, r, layout).logical for r in range(2)])
            found[f"{layout} order"] = torch.equal(every[order], torch.arange(whole_plan.logical_length))
        mine = "zigzag" if dist.get_rank(cp) == 0 else "contiguous"
        try:
            group_share(cp, plan(), SimpleNamespace(cp_layout=mine))
            found["mixed"] = None
        except ValueError as exc:
            found["mixed"] = str(exc)
    return found
