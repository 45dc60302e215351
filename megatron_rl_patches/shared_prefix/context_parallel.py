"""A shared-prefix plan over context-parallel ranks: the physical stream cut over the ranks, each
rank's queries attending every key the plan lets them see, wherever it lies.

Every rank builds the plan from the whole micro-batch (the ids and `cu_seqlens` before the
context-parallel cut) and hands the model its own share of the logical ids, cut as on the ordinary
path (`LOGICAL`: megatron-core's zigzag per sequence, or slime's `--allgather-cp` contiguous slice
of the stream); its logits come back at those same logical rows. In between the model runs the
physical stream, cut by `physical_share`: zigzag over the whole stream (2·cp equal chunks, rank r
holding chunks r and 2·cp−1−r, equal shares as the gathers need), which spreads the rule's attention
work near evenly (counted in keys seen, CP = 2: one group of P = 1,024, R = 128, G = 8 puts 1.16x
the mean on the busier rank, a contiguous cut 1.36x; four such groups, 1.00x). Each attention
gathers the keys and values of every rank's share (`gathered_stream`:
forward an all-gather, backward the gradients summed over the group, each rank keeping its own
rows) and computes its own rows against them (`pieces_of_rows`: the rule's blocks read at this
rank's query rows); the decoder's output is gathered the same way and read at this rank's logical
rows. Causal attention and the tree rule only say which keys a row sees, so the result is the one
rank's result, exactly. The other seams read the same share: multi-latent attention's own rotary
table at the share's positions (`mla`), an MoE router's statistics on the rank's logical rows
(`moe_statistics`), and each pipeline stage runs the share its previous stage sent."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron_rl_patches.ops.agreement import agree
from megatron_rl_patches.ops.context_rows import local_rows, sequence_rows
from megatron_rl_patches.shared_prefix.attention_rule import Block
from megatron_rl_patches.shared_prefix.plan import SharedPrefixPlan

LOGICAL = ("zigzag", "contiguous")  # how a caller cut its logical ids (megatron-core / slime; --allgather-cp)


def check_logical_layout(layout: Any) -> str:
    if layout not in LOGICAL:
        raise ValueError(f"shared prefix: cp_layout must be one of {', '.join(LOGICAL)} (how each context-parallel "
                         f"rank's ids were cut: megatron-core's zigzag per sequence, or a framework's --allgather-cp "
                         f"contiguous slice), got {layout!r}")
    return str(layout)


@dataclass(frozen=True, eq=False)
class Share:
    """One context-parallel rank's share of a plan: its `physical` rows (of the stream the model
    runs), where each physical row lies in the ranks' shares gathered in rank order (`gathered`
    [S]), and its `logical` rows (of the ids as packed, cut as the caller cut them: `layout`)."""

    size: int
    rank: int
    physical: torch.Tensor
    gathered: torch.Tensor
    logical: torch.Tensor
    layout: str


def physical_share(plan: SharedPrefixPlan, size: int, rank: int) -> torch.Tensor:
    """The physical rows rank `rank` of `size` runs: zigzag over the whole stream (cached per plan)."""
    def build() -> torch.Tensor:
        if plan.physical_length % (2 * size):
            raise ValueError(f"shared prefix: the plan's stream has {plan.physical_length} rows, which {size} "
                             f"context-parallel ranks cannot cut into {2 * size} equal chunks; build the plan with "
                             f"pad_to a multiple of {2 * size} (times the tensor-parallel size under sequence "
                             "parallelism)")
        return sequence_rows("zigzag", rank, size, plan.physical_length)

    return plan.cached(("cp-physical", size, rank), build)


def share_of(plan: SharedPrefixPlan, size: int, rank: int, layout: str) -> Share:
    """Rank `rank`'s share of `plan` over `size` context-parallel ranks whose logical ids were cut in
    `layout` (cached per plan)."""
    def build() -> Share:
        physical = physical_share(plan, size, rank)
        gathered = torch.empty(plan.physical_length, dtype=torch.int64)
        gathered[torch.cat([physical_share(plan, size, r) for r in range(size)])] = torch.arange(plan.physical_length)
        bounds = plan.sequence_bounds
        if int(bounds[-1]) < plan.logical_length:  # rows past the last boundary: one more sequence
            bounds = torch.cat([bounds, torch.tensor([plan.logical_length])])
        try:
            logical = local_rows(layout, rank, size, cu_seqlens=bounds)
        except ValueError as exc:
            raise ValueError(f"shared prefix: the micro-batch cannot be cut over {size} context-parallel ranks in "
                             f"the {layout} layout: {exc}") from None
        return Share(size, rank, physical, gathered, logical, layout)

    return plan.cached(("cp-share", size, rank, check_logical_layout(layout)), build)


def taken(plan: SharedPrefixPlan, share: Share, name: str, rows: str, device: Any) -> torch.Tensor:
    """The plan's tensor `name` read at the share's `rows` ("physical" / "logical") on `device`, kept."""
    device = torch.device(device)
    return plan.cached(("cp-taken", share.size, share.rank, name, rows, str(device)),
                       lambda: getattr(plan, name)[getattr(share, rows)].to(device))


class GatheredStream(torch.autograd.Function):
    """Every rank's rows (dim 0, equal counts) in rank order; backward the gradient summed over the
    group, each rank keeping its own rows (all-reduce then narrow: gloo has no reduce-scatter)."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group, ctx.rows, ctx.rank = group, local.size(0), dist.get_rank(group)
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, local.contiguous(), group=group)
        return torch.cat(parts, 0)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        summed = grad.contiguous().clone()
        dist.all_reduce(summed, group=ctx.group)
        return summed.narrow(0, ctx.rank * ctx.rows, ctx.rows), None


def gathered_stream(local: torch.Tensor, plan: SharedPrefixPlan, share: Share, group: Any) -> torch.Tensor:
    """This rank's physical rows (dim 0) -> the whole physical stream in order (autograd: each rank's
    gradient reaches the rank that computed the rows)."""
    whole = GatheredStream.apply(local, group)
    order = plan.cached(("cp-gathered", share.size, str(whole.device)), lambda: share.gathered.to(whole.device))
    return whole.index_select(0, order)


def pieces_of_rows(blocks: tuple[Block, ...], rows: torch.Tensor) -> tuple[Block, ...]:
    """The rule's `blocks` read at the query rows `rows` (ascending runs of physical rows), the rows
    renumbered as the query holds them (0 up), the keys still physical: a segment's own block cut
    at a row r0 inside it becomes its rows against [r0, r1) causally and against [start, r0) wholly;
    a masked block keeps its mask's rows; every row's own segment first, as `BlockAttention` takes
    them."""
    values = rows.tolist()
    runs: list[tuple[int, int, int]] = []  # (first physical row, end, local offset)
    for index, row in enumerate(values):
        if runs and row == runs[-1][1]:
            runs[-1] = (runs[-1][0], row + 1, runs[-1][2])
        else:
            runs.append((row, row + 1, index))
    own: list[Block] = []
    rest: list[Block] = []
    for block in blocks:
        first, last = block.rows
        for low, high, offset in runs:
            r0, r1 = max(first, low), min(last, high)
            if r0 >= r1:
                continue
            local = (r0 - low + offset, r1 - low + offset)
            if block.mask is not None:
                mask = block.mask[r0 - first:r1 - first]
                if block.own or bool(mask.any()):
                    (own if block.own else rest).append(Block(local, block.keys, block.own, mask))
            elif block.own:
                own.append(Block(local, (r0, r1), True))
                if r0 > block.keys[0]:
                    rest.append(Block(local, (block.keys[0], r0), False))
            else:
                rest.append(Block(local, block.keys, False))
    return (*own, *rest)


class WholeRotaryTable:
    """A plan's `packed_seq_params.cp_group`, read by megatron-core's rotary embedding alone (0.16 and
    later): it cuts its table per context-parallel rank where the group's size is above 1. A plan
    reads the table at each physical row's own position (`model_hooks.rotary_at_positions`), so it
    needs the table whole: the size it reads here is 1."""

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


def context_parallel_group(module: Any) -> Any | None:
    """The context-parallel group a module of a model runs over (its `pg_collection`'s, else
    megatron-core's parallel state), or None with one context-parallel rank."""
    if int(getattr(getattr(module, "config", None), "context_parallel_size", 1) or 1) == 1:
        return None
    group = getattr(getattr(module, "pg_collection", None), "cp", None)
    if group is None:
        from megatron.core import parallel_state  # lazy: optional dependency megatron-core

        group = parallel_state.get_context_parallel_group()
    return group if dist.get_world_size(group) > 1 else None


def module_share(module: Any, plan: SharedPrefixPlan, params: Any) -> tuple[Share, Any] | None:
    """(this rank's share of `plan`, the group) for a module of a context-parallel model, or None."""
    return group_share(context_parallel_group(module), plan, params)


def group_share(group: Any, plan: SharedPrefixPlan, params: Any) -> tuple[Share, Any] | None:
    """(this rank's share of `plan` over `group`, the group), or None for no group or one rank."""
    if group is None or dist.get_world_size(group) == 1:
        return None
    layout = getattr(params, "cp_layout", "zigzag")
    # before the plan's first collective on this rank: ranks given ids cut differently would read wrong rows
    plan.cached(("cp-layout-agreed", layout), lambda: agree(
        group, "a shared-prefix plan's context-parallel layout (shared_prefix_params' cp_layout)",
        match={"cp_layout": layout, "physical rows": plan.physical_length, "logical rows": plan.logical_length},
        where="the context-parallel group"))
    return share_of(plan, dist.get_world_size(group), dist.get_rank(group), layout), group


def gathered_logical_order(plan: SharedPrefixPlan, share: Share, device: Any) -> torch.Tensor:
    """[T]: where each logical row lies in every rank's logical rows gathered in rank order (cached)."""
    def build() -> torch.Tensor:
        every = torch.cat([share_of(plan, share.size, r, share.layout).logical for r in range(share.size)])
        order = torch.empty(plan.logical_length, dtype=torch.int64)
        order[every] = torch.arange(every.numel())
        return order.to(device)

    return plan.cached(("cp-logical-order", share.size, share.layout, str(torch.device(device))), build)
