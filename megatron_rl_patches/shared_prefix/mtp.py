"""Multi-token prediction (megatron-core's `MultiTokenPredictionBlock`: MiMo's, GLM-4.7-Flash's,
DeepSeek-V3's) under a shared-prefix plan: each depth computes the rows its samples share once.

The MTP layer of depth d sees at row t of a sample the state of depth d - 1 at t (the decoder's at
depth 1) and the embedding of token t + d (megatron-core rolls the ids by one per depth within each
sequence, the last rows of a sequence reading id 0). So row t holds one value for every sample
whose tokens 0..t + d agree: at a prefix's last row each member's next token differs, and the
prefix shares one row less per depth. The depth's stream is a plan of its own (`depth_plan`), built
from the main plan's physical rows read d rows ahead (a physical row stands for its tokens 0..t,
so two rows agree d ahead exactly when their samples agree up to t + d); a row whose t + d is past
its sequence's end is its sample's own. The padding after the samples runs as megatron-core packs
it (each padding sequence its rows chained at their own positions, the last d reading id 0; the
main stream computes each padding row by its own id, so each depth's does too).

Each MTP layer's call then runs the depth's stream (`physical_layer_inputs`, a pre-hook): the
previous depth's state (held at the logical rows) read at one logical row of each physical row,
megatron-core's own roll of the logical ids and positions read there too (`roll_tensor` in the MTP
module answers a plan's params that way), and the depth's plan as the call's `packed_seq_params`,
so the layer's attention, its rotary table (MLA's too) and an MoE layer's statistics (counted per
sample, `moe_statistics`) take the depth's segments and positions. Its output is read back at each
logical row (`logical_layer_output`), so the block hands megatron-core's loss the rows it hands it
today: every depth's loss, its labels and mask rolled per sample (megatron-core rolls them with the
call's params: the GPT module's `roll_tensor` / `process_mtp_loss` reads a plan's params as the
logical ones), and every gradient (summed back into each shared row by the reads) are the packed
path's. Each layer's hook is bound to its depth (its place in the block) when the block is prepared,
and the depth's params carry the main plan the layer's output is read back at (`main_plan`).

Under context parallelism (`context_parallel`) the block holds this rank's share of the logical rows,
cut as the caller cut its ids. Each depth's stream is cut over the ranks as the main one (zigzag over
its physical rows, padded to 2 * CP chunks): the layer's input gathers every rank's logical rows of the
previous depth and reads them at this rank's physical rows, its attention gathers every rank's keys and
values as the decoder's does (the depth's plan in its params), and its output gathers every rank's
physical rows and reads this rank's logical rows. The ids, labels and loss mask are rolled on the
whole logical rows as at one rank and read at this rank's rows (`logical_share_roll`): what
megatron-core's own exchange of boundary tokens gives a zigzag share, and a contiguous one too."""
# lazy imports: optional dependency megatron-core
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch

from megatron_rl_patches.model.arguments import ArgumentsByName
from megatron_rl_patches.shared_prefix.context_parallel import (
    GatheredStream,
    Share,
    context_parallel_group,
    gathered_logical_order,
    gathered_stream,
    group_share,
)
from megatron_rl_patches.shared_prefix.plan import (
    SharedPrefixPlan,
    physical_readers,
    plan_shared_prefix,
    shared_prefix_plan_of,
)

ROLL_MARK = "_megatron_rl_patches_shared_prefix_roll"


@dataclasses.dataclass(frozen=True, eq=False)
class LogicalShareRoll:
    """The params megatron-core's loss rolls its labels and mask with under a plan at context
    parallelism: this rank's share of the logical rows, rolled per sequence of the whole."""

    plan: SharedPrefixPlan
    share: Share
    group: Any


def logical_positions(plan: SharedPrefixPlan) -> torch.Tensor:
    """[T]: each logical row's position in its own sequence (a sample's, a padding sequence's), as the
    packed path numbers it (`logical_bounds`)."""
    def build() -> torch.Tensor:
        bounds = torch.tensor(logical_bounds(plan), dtype=torch.int64)
        return torch.arange(plan.logical_length) - torch.repeat_interleave(bounds[:-1], bounds.diff())

    return plan.cached(("mtp-positions",), build)


def logical_bounds(plan: SharedPrefixPlan) -> list[int]:
    """The micro-batch's sequences as packed (megatron-core rolls each on its own): the `cu_seqlens`
    the plan was built from, an empty sequence dropped, the rows past its end one more sequence (as
    the plan runs them)."""
    def build() -> list[int]:
        bounds = sorted(set(plan.sequence_bounds.tolist()))
        return bounds + ([plan.logical_length] if plan.logical_length > bounds[-1] else [])

    return plan.cached(("mtp-bounds",), build)


def logical_params(plan: SharedPrefixPlan) -> Any:
    """megatron-core's `thd` params of the micro-batch as packed (`logical_bounds`)."""
    def build() -> Any:
        from megatron.core.packed_seq_params import PackedSeqParams

        cu = torch.tensor(logical_bounds(plan), dtype=torch.int32)
        longest = int(cu.diff().max()) if cu.numel() > 1 else 1
        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
                               max_seqlen_kv=longest)

    return plan.cached(("mtp-params",), build)


def depth_plan(plan: SharedPrefixPlan, depth: int, pad_to: int = 1) -> SharedPrefixPlan:
    """The plan of MTP depth `depth`'s stream (its physical rows padded to a multiple of `pad_to`):
    the same logical rows, a row shared by the samples whose main-stream rows d ahead are one
    physical row; a row whose d ahead is past its sequence's end its sample's own; the padding
    sequence a sample of its own."""
    def build() -> SharedPrefixPlan:
        bounds = logical_bounds(plan)
        rows = torch.arange(plan.logical_length)
        ends = torch.repeat_interleave(torch.tensor(bounds[1:]), torch.tensor(bounds).diff())
        ahead = rows + depth
        keys = torch.where(ahead < ends, plan.logical_rows[ahead.clamp(max=max(plan.logical_length - 1, 0))],
                           plan.physical_length + rows)  # past the end: a key no other row holds
        return plan_shared_prefix(keys, bounds, pad_to=pad_to)

    return plan.cached(("mtp-depth", depth, pad_to), build)


def rolled_logical(plan: SharedPrefixPlan, name: str, times: int, device: Any) -> torch.Tensor:
    """[1, T]: the logical ids ("ids") or positions rolled `times` by megatron-core's own per-sequence roll."""
    def build() -> torch.Tensor:
        if times == 0:
            return (plan.logical_tokens if name == "ids" else logical_positions(plan))[None].to(device)
        from megatron.core.transformer import multi_token_prediction

        earlier = rolled_logical(plan, name, times - 1, device)
        params = logical_params(plan)
        return multi_token_prediction.roll_tensor(earlier, shifts=-1, dims=-1, packed_seq_params=params)[0]

    return plan.cached(("mtp-rolled", name, times, str(torch.device(device))), build)


def sequence_parallel_ranks(config: Any) -> int:
    if not getattr(config, "sequence_parallel", False):
        return 1
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_world_size()


def read_rows(hidden: torch.Tensor, rows: torch.Tensor, config: Any, whole_of: Any = None) -> torch.Tensor:
    """`hidden` ([n, b, h], under sequence parallelism each rank's share) read at `rows` of the whole,
    the result split the same way (every rank reads the whole: its gradient is the whole, kept split).
    `whole_of`: under context parallelism, the stream over every context-parallel rank of this rank's rows."""
    ranks = sequence_parallel_ranks(config)
    if ranks == 1 and whole_of is None:
        return hidden.index_select(0, rows.to(hidden.device))
    from megatron.core import tensor_parallel

    if rows.numel() % ranks:
        raise ValueError(f"shared prefix: under sequence parallelism the MTP block's {rows.numel()} rows must split "
                         f"evenly over the {ranks} tensor-parallel ranks")
    if ranks > 1:
        hidden = tensor_parallel.gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
    if whole_of is not None:
        hidden = whole_of(hidden)
    rows = hidden.index_select(0, rows.to(hidden.device))
    return tensor_parallel.scatter_to_sequence_parallel_region(rows) if ranks > 1 else rows


def logical_whole(local: torch.Tensor, plan: SharedPrefixPlan, share: Share, group: Any) -> torch.Tensor:
    """This context-parallel rank's logical rows (dim 0) -> every logical row of `plan` in order
    (autograd: each rank's gradient summed back into the rank holding the row)."""
    whole = GatheredStream.apply(local, group)
    return whole.index_select(0, gathered_logical_order(plan, share, whole.device))


def stream_reader(stream: SharedPrefixPlan, share: Share | None, device: Any) -> torch.Tensor:
    """A logical row of each physical row this rank runs of the depth's stream (its `share`, or all)."""
    rows = physical_readers(stream, device)
    if share is None:
        return rows
    return stream.cached(("mtp-reader-share", share.size, share.rank, str(torch.device(device))),
                         lambda: rows.index_select(0, share.physical.to(rows.device)))


def logical_mtp_inputs(module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """Forward pre-hook of the MTP block: the packed ids and positions of the plan's micro-batch (the
    decoder's states arrive at the logical rows already)."""
    call = ArgumentsByName.of_forward(module, args, kwargs)
    plan = shared_prefix_plan_of(call.get("packed_seq_params"))
    if plan is None:
        return None
    hidden = call.get("hidden_states")
    device = hidden.device if isinstance(hidden, torch.Tensor) else torch.device("cpu")
    call.set("input_ids", rolled_logical(plan, "ids", 0, device))
    call.set("position_ids", rolled_logical(plan, "positions", 0, device))
    return call.done()


def physical_layer_inputs(layer: Any, args: tuple, kwargs: dict, *, depth: int) -> tuple[tuple, dict] | None:
    """Forward pre-hook of the MTP layer of depth `depth` (1 for the block's first): its depth's
    physical rows of the previous depth's state, the logical ids and positions as rolled before this
    depth, and the depth's plan as the call's params (with the main plan, to read the output back at)."""
    call = ArgumentsByName.of_forward(layer, args, kwargs)
    params = call.get("packed_seq_params")
    plan = shared_prefix_plan_of(params)
    if plan is None:
        return None
    hidden = call.get("hidden_states")
    group = context_parallel_group(layer)
    held = group_share(group, plan, params)
    # under context parallelism the stream is cut as the main one: 2 * CP equal chunks (each split over SP)
    stream = depth_plan(plan, depth, sequence_parallel_ranks(layer.config) * (1 if held is None else 2 * held[0].size))
    whole = torch.tensor([0, stream.physical_length], dtype=torch.int32)
    stream_params = dataclasses.replace(params, shared_prefix=stream, cu_seqlens_q=whole, cu_seqlens_kv=whole,
                                        main_plan=plan)
    if held is None:
        rows = read_rows(hidden, physical_readers(stream, hidden.device), layer.config)
    else:  # every rank's logical rows of the previous depth, read at this rank's physical rows of the stream
        share, _ = held
        mine = group_share(group, stream, stream_params)
        rows = read_rows(hidden, stream_reader(stream, None if mine is None else mine[0], hidden.device), layer.config,
                         whole_of=lambda local: logical_whole(local, plan, share, group))
    if hidden._base is not None:
        # a view (the block's chunk of the decoder's states) handed on as one: a layer that drops a view's
        # graph (slime's MTP patch: make_viewless_tensor(keep_graph=False)) drops it as on the packed path
        rows = rows.view_as(rows)
    call.set("hidden_states", rows)
    call.set("input_ids", rolled_logical(plan, "ids", depth - 1, hidden.device))
    call.set("position_ids", rolled_logical(plan, "positions", depth - 1, hidden.device))
    call.set("packed_seq_params", stream_params)
    return call.done()


def logical_layer_output(layer: Any, args: tuple, kwargs: dict, output: Any) -> Any:
    """Forward hook of an MTP layer: its state read back at each logical row (what the block hands on)."""
    params = ArgumentsByName.of_forward(layer, args, kwargs).get("packed_seq_params")
    stream = shared_prefix_plan_of(params)
    if stream is None:
        return None
    hidden, *rest = output
    plan = params.main_plan  # its cp_layout is the main params' (the depth's params replace only the plan)
    group = context_parallel_group(layer)
    held = group_share(group, plan, params)
    if held is None:
        return (read_rows(hidden, stream.on(hidden.device, "logical_rows"), layer.config), *rest)
    share, _ = held  # the stream over every rank, read at this rank's logical rows (as the caller cut them)
    mine = group_share(group, stream, params)
    assert mine is not None
    logical = stream.cached(("mtp-logical-share", share.size, share.rank, share.layout, str(hidden.device)),
                            lambda: stream.logical_rows[share.logical].to(hidden.device))
    return (read_rows(hidden, logical, layer.config,
                      whole_of=lambda local: gathered_stream(local, stream, mine[0], group)), *rest)


def logical_share_roll(original: Any, call: ArgumentsByName, held: LogicalShareRoll) -> tuple[torch.Tensor, Any]:
    """megatron-core's per-sequence roll (`original`) of this context-parallel rank's share of the logical
    rows (labels, loss mask; no gradient): every rank's share gathered in logical order, rolled whole
    as at one rank, read back at this rank's rows (what megatron-core's own exchange gives its zigzag
    share, for either layout)."""
    plan, share, group = held.plan, held.share, held.group
    tensor, shifts, dims = call.get("tensor"), call.get("shifts") or -1, call.get("dims") or -1
    parts = [torch.empty_like(tensor) for _ in range(share.size)]
    torch.distributed.all_gather(parts, tensor.contiguous(), group=group)
    whole = torch.cat(parts, -1).index_select(-1, gathered_logical_order(plan, share, tensor.device))
    rolled, _ = original(whole, shifts=shifts, dims=dims, cp_group=None, packed_seq_params=logical_params(plan))
    rows = rolled.index_select(-1, share.logical.to(rolled.device))
    return rows, rows.sum()


def install_label_roll() -> None:
    """megatron-core's GPT module rolls the MTP labels and loss mask by the call's params (0.16: its
    `roll_tensor` in `_postprocess`; 0.19: `process_mtp_loss`, which also derives labels from the
    call's ids where none are given): a plan's params are read as the micro-batch's logical ones, its
    ids as the packed ids (once per process; other calls unchanged: `planned_label_roll`)."""
    from megatron.core.models.gpt import gpt_model

    name = "process_mtp_loss" if hasattr(gpt_model, "process_mtp_loss") else "roll_tensor"
    original = getattr(gpt_model, name, None)
    if original is None or getattr(original, ROLL_MARK, False):
        return
    setattr(gpt_model, name, planned_label_roll(original, name))


def planned_label_roll(original: Any, name: str = "process_mtp_loss") -> Any:
    """`original` (megatron-core's `process_mtp_loss`, or 0.16's `roll_tensor` as the GPT module calls it;
    `name` says which) reading a plan's params as the micro-batch's logical ones and its ids as the packed
    ids; a call without a plan as it is. A framework's own copy of the GPT module's MTP loss (verl's) wraps
    the function it bound with it."""
    if getattr(original, ROLL_MARK, False):
        return original

    @functools.wraps(original)
    def logical(*args: Any, **kwargs: Any) -> Any:
        call = ArgumentsByName(original, args, kwargs)
        params = call.get("packed_seq_params")
        plan = shared_prefix_plan_of(params)
        if plan is not None:
            held = group_share(call.get("cp_group"), plan, params)
            if held is not None and name == "roll_tensor":
                return logical_share_roll(original, call, LogicalShareRoll(plan, *held))
            call.set("packed_seq_params", logical_params(plan) if held is None else LogicalShareRoll(plan, *held))
            ids = call.get("input_ids")
            if isinstance(ids, torch.Tensor):
                call.set("input_ids", plan.on(ids.device, "logical_tokens")[None] if held is None
                         else ids.new_tensor(plan.logical_tokens[held[0].logical])[None])
            args, kwargs = call.done()
        return original(*args, **kwargs)

    setattr(logical, ROLL_MARK, True)
    return logical


def install_depth_roll() -> None:
    """megatron-core's MTP layer rolls the ids and positions it embeds by the call's params: under a
    depth's plan, the logical ones rolled per sequence, then read at one logical row of each of the
    depth's physical rows (once per process; other calls unchanged)."""
    from megatron.core.transformer import multi_token_prediction

    original = multi_token_prediction.roll_tensor
    if getattr(original, ROLL_MARK, False):
        return

    @functools.wraps(original)
    def physical(*args: Any, **kwargs: Any) -> Any:
        call = ArgumentsByName(original, args, kwargs)
        params = call.get("packed_seq_params")
        if isinstance(params, LogicalShareRoll):  # megatron-core's loss (0.19) at context parallelism
            return logical_share_roll(original, call, params)
        stream = shared_prefix_plan_of(params)
        if stream is None:
            return original(*args, **kwargs)
        held = group_share(call.get("cp_group"), stream, params)
        call.set("packed_seq_params", logical_params(stream))
        call.set("cp_group", None)  # the whole logical ids, rolled as at one rank, read at this rank's rows
        args, kwargs = call.done()
        rolled, _ = original(*args, **kwargs)
        rows = rolled.index_select(-1, stream_reader(stream, None if held is None else held[0], rolled.device))
        return rows, rows.sum()

    setattr(physical, ROLL_MARK, True)
    multi_token_prediction.roll_tensor = physical


def prepare_mtp_block(block: Any) -> None:
    block.register_forward_pre_hook(logical_mtp_inputs, with_kwargs=True)
    for index, layer in enumerate(block.layers):  # megatron-core's block calls them in order, depth 1 first
        layer.register_forward_pre_hook(functools.partial(physical_layer_inputs, depth=index + 1), with_kwargs=True)
        layer.register_forward_hook(logical_layer_output, with_kwargs=True)
    install_label_roll()
    install_depth_roll()
