"""A step's micro-batches planned together: every leading-token sequence the step's samples share is
computed once per step, however the micro-batch budget cut them.

The samples of every micro-batch are laid out as one trie (`tree.tree_layout` over the step's
samples): its segments are the step's. Each micro-batch's plan is that trie cut down to the segments
its own samples pass through (a segment keeps the step's bounds, so a prompt whose group the budget
split is the same segment in every micro-batch holding a member). A segment read by one micro-batch
is computed there as before; one read by several is **held** (`held`): its first reader computes it
in a side pass before its own rows, every reader computes only its own rows against the held state,
and the last reader (its owner) recomputes it in its backward, once, with every reader's gradient.

`plan_shared_prefix_step(micro_batches)` returns the plans (`SharedPrefixStep.plans`, one per
micro-batch, each passed as that micro-batch's `shared_prefix_params(plan)`) and the step's figures
(`StepStats`). Run the micro-batches in order, each once (megatron-core's schedules do, forward then
backward per micro-batch without pipeline parallelism); plan each pass (training, each forward-only
pass) on its own."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from megatron_rl_patches.ops.agreement import gathered_objects
from megatron_rl_patches.shared_prefix.held import MAIN, RECOMPUTE, SIDE, HeldRows, HeldSegment, HeldStore
from megatron_rl_patches.shared_prefix.plan import (
    MicroBatch,
    PlanStats,
    SharedPrefixPlan,
    checked_micro_batch,
    plan_of_layout,
)
from megatron_rl_patches.shared_prefix.tree import TreeLayout, run_of, tree_layout

NAME = "plan_shared_prefix_step"


@dataclass(frozen=True)
class StepStats:
    """A step's tokens: as packed (each sample whole, padding left out), computed by the model (each
    segment once, side passes included, padding left out) and recomputed in backward (held segments),
    the rows held across micro-batches, and the micro-batches."""

    micro_batches: int
    logical_tokens: int
    computed_tokens: int
    recomputed_tokens: int
    held_tokens: int

    def as_dict(self) -> dict[str, int]:
        return {"micro_batches": self.micro_batches, "logical_tokens": self.logical_tokens,
                "computed_tokens": self.computed_tokens, "recomputed_tokens": self.recomputed_tokens,
                "held_tokens": self.held_tokens}


@dataclass(frozen=True)
class SharedPrefixStep:
    """The plans of a step's micro-batches (in order), the held state they share and the figures."""

    plans: tuple[SharedPrefixPlan, ...]
    store: HeldStore
    stats: StepStats


@dataclass(frozen=True)
class Forest:
    """Some of a tree's segments (their step indices, `kept`, in preorder) laid out on their own:
    first row, parent (an index into `kept`, -1 under the root) and the end of each one's subtree."""

    kept: torch.Tensor
    starts: torch.Tensor
    lengths: torch.Tensor
    parents: torch.Tensor
    reach: torch.Tensor

    @property
    def rows(self) -> int:
        return int(self.lengths.sum())

    def held(self, segments: set[int]) -> tuple[HeldSegment, ...]:
        return tuple(HeldSegment(int(s), int(a), int(a + n)) for s, a, n in
                     zip(self.kept.tolist(), self.starts.tolist(), self.lengths.tolist()) if int(s) in segments)


def forest(tree: TreeLayout, kept: torch.Tensor) -> Forest:
    """`tree`'s segments `kept` (ascending step indices, closed under parents) laid out in preorder."""
    lengths = tree.lengths.index_select(0, kept)
    starts = lengths.cumsum(0) - lengths
    where = torch.full((tree.lengths.numel(),), -1, dtype=torch.int64)
    where[kept] = torch.arange(kept.numel())
    step_parents = tree.parents.index_select(0, kept)
    parents = torch.where(step_parents < 0, step_parents, where[step_parents.clamp(min=0)])
    subtree = lengths.clone()
    for index in range(kept.numel() - 1, -1, -1):  # children after their parent: summed from the end
        up = int(parents[index])
        if up >= 0:
            subtree[up] += subtree[index]
    return Forest(kept, starts, lengths, parents, starts + subtree)


def closed(tree: TreeLayout, segments: set[int]) -> torch.Tensor:
    """`segments` and every ancestor of one, ascending."""
    found = set()
    for segment in segments:
        while segment >= 0 and segment not in found:
            found.add(segment)
            segment = int(tree.parents[segment])
    return torch.tensor(sorted(found), dtype=torch.int64)


def held_rows(store: HeldStore, mode: str, index: int, layout: Forest, held: set[int], exports: set[int],
              length: int) -> HeldRows:
    """The held rows of a plan of `length` virtual rows laid out as `layout`."""
    held_segments = layout.held(held)
    is_held = torch.zeros(length, dtype=torch.bool)
    for one in held_segments:
        is_held[one.start:one.end] = True
    computed_rows = (~is_held).nonzero().flatten()
    order = torch.empty(length, dtype=torch.int64)
    held_rows_in_order = torch.cat([torch.arange(one.start, one.end) for one in held_segments]) if held_segments \
        else torch.empty(0, dtype=torch.int64)
    order[held_rows_in_order] = torch.arange(held_rows_in_order.numel())
    order[computed_rows] = held_rows_in_order.numel() + torch.arange(computed_rows.numel())
    return HeldRows(store=store, mode=mode, micro_batch=index, held=held_segments, exports=layout.held(exports),
                    computed=computed_rows, order=order)


def segment_rows(tree: TreeLayout, segments: set[int], pad_to: int) -> int:
    """The rows a pass of `segments` computes: theirs, padded to `pad_to` (an empty pass: `pad_to`)."""
    rows = sum(int(tree.lengths[s]) for s in segments)
    return rows + (-rows) % pad_to if segments else pad_to


def segment_plan(tree: TreeLayout, ids: torch.Tensor, segments: set[int], store: HeldStore, mode: str, index: int,
                 pad_to: int, at_least: int = 0) -> SharedPrefixPlan:
    """The plan of a side pass or a recompute: `segments` computed (and kept for the step), their
    ancestors held, no sample rows (no logical rows: the pass leaves its output to the readers); at
    least `at_least` rows computed (padding)."""
    kept = closed(tree, segments)
    layout = forest(tree, kept)
    ancestors = set(kept.tolist()) - segments
    held_length = sum(int(tree.lengths[s]) for s in ancestors)
    padding = max(segment_rows(tree, segments, pad_to), at_least) - (layout.rows - held_length)
    rows = layout.rows + padding
    lengths = torch.cat([layout.lengths, torch.tensor([padding])]) if padding else layout.lengths
    starts = lengths.cumsum(0) - lengths
    parents = torch.cat([layout.parents, torch.tensor([-1])]) if padding else layout.parents
    reach = torch.cat([layout.reach, torch.tensor([rows])]) if padding else layout.reach
    depths = tree.depths.index_select(0, kept)
    step_positions = tree.positions.index_select(0, kept)
    sources = tree.sources.index_select(0, kept)
    if padding:
        depths, step_positions = torch.cat([depths, torch.tensor([0])]), torch.cat([step_positions, torch.tensor([0])])
    segment_of = run_of(lengths)
    local = torch.arange(rows) - starts[segment_of]
    positions = step_positions[segment_of] + local
    tokens = torch.zeros(rows, dtype=torch.int64)
    real = layout.rows
    if real:
        tokens[:real] = ids[sources[segment_of[:real]] + local[:real]]
    plan = SharedPrefixPlan(
        tokens=tokens, positions=positions, segments=segment_of, reach=reach[segment_of], segment_starts=starts,
        segment_parents=parents, segment_depths=depths, logical_rows=torch.empty(0, dtype=torch.int64),
        logical_tokens=torch.empty(0, dtype=torch.int64), groups=(),
        stats=PlanStats(samples=0, logical_tokens=0, physical_tokens=layout.rows - held_length, groups=0,
                        shared_samples=0, alone=0),
        padding_rows=padding, sequence_bounds=torch.zeros(1, dtype=torch.int64))
    plan.held = held_rows(store, mode, index, layout, ancestors, segments, rows)
    return plan


def _count(name: str, value: Any, low: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{NAME}: {name} must be an int >= {low}, got {value!r}")
    return value


def _batches(micro_batches: Any, samples: Any) -> list[MicroBatch]:
    if not isinstance(micro_batches, Sequence) or isinstance(micro_batches, (str, bytes)) or not micro_batches:
        raise TypeError(f"{NAME}: micro_batches must be a non-empty sequence of (tokens, cu_seqlens) pairs, one per "
                        f"micro-batch of the step, got {type(micro_batches).__name__}")
    if samples is not None and (not isinstance(samples, Sequence) or len(samples) != len(micro_batches)):
        raise ValueError(f"{NAME}: samples must hold one count per micro-batch ({len(micro_batches)}), got "
                         f"{samples!r:.80}")
    batches = []
    for i, pair in enumerate(micro_batches):
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise TypeError(f"{NAME}: micro_batches[{i}] must be a (tokens, cu_seqlens) pair, got "
                            f"{type(pair).__name__}")
        try:
            batches.append(checked_micro_batch(pair[0], pair[1], None if samples is None else samples[i]))
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{NAME}: micro_batches[{i}]: {exc}") from None
    return batches


def chunked(tree: TreeLayout, most: int | None) -> tuple[TreeLayout, list[int]]:
    """`tree` with every segment longer than `most` rows cut into a chain of pieces of at most `most`
    (each piece the parent of the next, the last the parent of the segment's children; the rows do not
    move), and for each new segment the one it was cut from."""
    lengths = tree.lengths.tolist()
    if most is None or all(n <= most for n in lengths):
        return tree, list(range(len(lengths)))
    starts, parents, positions, sources, reach, origin = [], [], [], [], [], []
    last_piece: dict[int, int] = {}
    for segment, length in enumerate(lengths):
        up = int(tree.parents[segment])
        parent = last_piece[up] if up >= 0 else -1
        for offset in range(0, max(length, 1), most):
            starts.append(int(tree.starts[segment]) + offset)
            parents.append(parent)
            positions.append(int(tree.positions[segment]) + offset)
            sources.append(int(tree.sources[segment]) + offset)
            reach.append(int(tree.reach[segment]))
            origin.append(segment)
            parent = len(starts) - 1
        last_piece[segment] = parent
    starts_t = torch.tensor(starts, dtype=torch.int64)
    ends = torch.cat([starts_t[1:], torch.tensor([tree.rows])])
    parents_t = torch.tensor(parents, dtype=torch.int64)
    depths = torch.zeros(len(starts), dtype=torch.int64)
    for index, up in enumerate(parents):  # parents come first: depth is theirs plus one
        depths[index] = 0 if up < 0 else depths[up] + 1
    return TreeLayout(starts=starts_t, lengths=ends - starts_t, parents=parents_t, depths=depths,
                      positions=torch.tensor(positions, dtype=torch.int64),
                      sources=torch.tensor(sources, dtype=torch.int64), reach=torch.tensor(reach, dtype=torch.int64),
                      tops=tree.tops, logical_rows=tree.logical_rows), origin


def units(tree: TreeLayout, segments: set[int], most: int | None) -> list[set[int]]:
    """`segments` in preorder, cut into runs of at most `most` rows (each a pass of its own)."""
    out: list[set[int]] = []
    rows = 0
    for segment in sorted(segments):
        length = int(tree.lengths[segment])
        if not out or (most is not None and rows + length > most):
            out.append(set())
            rows = 0
        out[-1].add(segment)
        rows += length
    return out


def plan_shared_prefix_step(micro_batches: Sequence[Any], *, samples: Sequence[int] | None = None,
                            pad_to: int = 1, min_shared: int = 1, levels: int | None = None,
                            max_tokens: int | None = None, group: Any = None,
                            repeated_padding_once: bool = False) -> SharedPrefixStep:
    """The shared-prefix plans of one step's micro-batches, `micro_batches[i]` = (tokens [T_i] or
    [1, T_i], cu_seqlens [n_i + 1]) packed as for `plan_shared_prefix` (`samples[i]`: how many of its
    sequences are samples; `pad_to`, `min_shared`, `levels`, `repeated_padding_once` as there, over the
    step's samples).
    `max_tokens`: the most rows any one forward computes (the micro-batch budget): a segment longer
    is cut into chunks, each continuing the one before, and a micro-batch whose own rows exceed it
    holds its largest segments (side pass, recompute) until they fit. `group`: ranks whose forwards run
    collectives together while holding other samples (the expert-parallel group: MoE dispatch): their
    passes are agreed (each micro-batch's side passes and recomputes as many on every rank, a pass of
    padding where a rank has fewer, each pass as many rows as the most any rank computes in it:
    megatron-core's allgather dispatcher gathers equal shares), an all-gather over it; TP and CP ranks
    hold the same samples and need none."""
    batches = _batches(micro_batches, samples)
    pad_to, min_shared = _count("pad_to", pad_to, 1), _count("min_shared", min_shared, 1)
    if levels is not None:
        _count("levels", levels, 1)
    if max_tokens is not None:
        _count("max_tokens", max_tokens, 1)
    pieces, starts, ends, owner = [], [], [], []
    at = 0
    for index, batch in enumerate(batches):
        for start, end in zip(batch.starts, batch.ends):
            pieces.append(batch.ids[start:end])
            starts.append(at)
            at += end - start
            ends.append(at)
            owner.append(index)
    ids = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.int64)
    tree, origin = chunked(tree_layout(ids, starts, ends, min_shared, levels), max_tokens)
    segment_of_row = run_of(tree.lengths)
    token_batch = torch.repeat_interleave(torch.tensor(owner, dtype=torch.int64),
                                          torch.tensor([e - s for s, e in zip(starts, ends)], dtype=torch.int64))
    token_segment = segment_of_row.index_select(0, tree.logical_rows) if ids.numel() else segment_of_row
    readers: list[set[int]] = [set() for _ in range(tree.lengths.numel())]
    for segment, batch in torch.unique(torch.stack([token_segment, token_batch]), dim=1).t().tolist():
        readers[segment].add(batch)
    # held: read by two or more micro-batches, or a piece before the last of a cut segment
    held = {s for s, who in enumerate(readers) if len(who) > 1}
    held |= {s for s in range(len(origin) - 1) if origin[s + 1] == origin[s] and int(tree.parents[s + 1]) == s}
    token_at = 0
    mine: list[torch.Tensor] = []
    for batch in batches:
        count = sum(e - s for s, e in zip(batch.starts, batch.ends))
        mine.append(torch.unique(token_segment[token_at:token_at + count]))
        token_at += count
    if max_tokens is not None:  # a micro-batch's own rows past the budget: its largest segments held
        for kept in mine:
            own = sorted((s for s in kept.tolist() if s not in held), key=lambda s: -int(tree.lengths[s]))
            rows = sum(int(tree.lengths[s]) for s in own)
            while own and rows + pad_to > max_tokens:
                largest = own.pop(0)
                held.add(largest)
                rows -= int(tree.lengths[largest])
    store = HeldStore()
    shapes = []  # per micro-batch: its layout, held segments, side and owned units, main rows
    token_at = 0
    for index, (batch, kept) in enumerate(zip(batches, mine)):
        count = sum(e - s for s, e in zip(batch.starts, batch.ends))
        layout = forest(tree, kept)
        read = {s for s in kept.tolist() if s in held}
        tree_of_batch = _layout_of(tree, layout, batch, tree.logical_rows[token_at:token_at + count], segment_of_row,
                                   kept)
        token_at += count
        held_length = sum(int(tree.lengths[s]) for s in read)
        main = plan_of_layout(batch, tree_of_batch, pad_to, held_rows=held_length,
                              repeated_padding_once=repeated_padding_once)
        first = units(tree, {s for s in read if min(readers[s]) == index}, max_tokens)
        last = units(tree, {s for s in read if max(readers[s]) == index}, max_tokens)
        shapes.append((layout, read, tree_of_batch, held_length, main, first, last))
    agreed = _agreed_passes(group, [(main.physical_length - held_length,
                                     [segment_rows(tree, one, pad_to) for one in first],
                                     [segment_rows(tree, one, pad_to) for one in last])
                                    for _, _, _, held_length, main, first, last in shapes])
    plans = []
    computed_tokens = recomputed = 0
    for index, ((layout, read, tree_of_batch, held_length, plan, first, last), (rows_main, side_rows, owned_rows)) in \
            enumerate(zip(shapes, agreed)):
        if rows_main > plan.physical_length - held_length:  # as many rows as the group's most
            plan = plan_of_layout(batches[index], tree_of_batch, pad_to, held_rows=held_length, at_least=rows_main,
                                  repeated_padding_once=repeated_padding_once)
        first = first + [set() for _ in range(len(side_rows) - len(first))]  # empty passes: as many as every rank
        last = last + [set() for _ in range(len(owned_rows) - len(last))]
        holding = held_rows(store, MAIN, index, layout, read, set(), plan.physical_length)
        holding.side = tuple(segment_plan(tree, ids, one, store, SIDE, index, pad_to, n)
                          for one, n in zip(first, side_rows))
        holding.owned = tuple(segment_plan(tree, ids, one, store, RECOMPUTE, index, pad_to, n)
                           for one, n in zip(last, owned_rows))
        holding.last = index == len(batches) - 1
        plan.held = holding
        plans.append(plan)
        computed_tokens += (plan.stats.physical_tokens - holding.held_rows
                            + sum(p.stats.physical_tokens for p in holding.side))
        recomputed += sum(p.stats.physical_tokens for p in holding.owned)
    stats = StepStats(micro_batches=len(batches), logical_tokens=int(ids.numel()), computed_tokens=computed_tokens,
                      recomputed_tokens=recomputed, held_tokens=sum(int(tree.lengths[s]) for s in held))
    return SharedPrefixStep(plans=tuple(plans), store=store, stats=stats)


Passes = tuple[int, list[int], list[int]]  # a micro-batch's main rows, its side passes' rows, its recomputes' rows


def _agreed_passes(group: Any, passes: list[Passes]) -> list[Passes]:
    """Each micro-batch's passes as the ranks of `group` run them together (None: these): as many
    side passes and recomputes as the most any rank runs, each as many rows as the most any computes."""
    if group is None:
        return passes
    every = [list(p) for p in gathered_objects(group, passes)]  # type: ignore[call-overload]
    if len({len(p) for p in every}) > 1:
        raise ValueError(f"{NAME}: the ranks of group plan steps of {sorted({len(p) for p in every})} micro-batches; "
                         "every rank of a group whose forwards run collectives together runs the same number")

    def most(lists: list[list[int]]) -> list[int]:
        longest = max(len(one) for one in lists)
        return [max(one[i] if i < len(one) else 0 for one in lists) for i in range(longest)]

    return [(max(p[i][0] for p in every), most([p[i][1] for p in every]), most([p[i][2] for p in every]))
            for i in range(len(passes))]


def _layout_of(tree: TreeLayout, layout: Forest, batch: MicroBatch, step_rows: torch.Tensor,
               segment_of_row: torch.Tensor, kept: torch.Tensor) -> TreeLayout:
    """A micro-batch's own samples laid out as the step's segments `layout` (its `TreeLayout`, in the
    micro-batch's logical rows); `step_rows`: each of its sample tokens' row in the step's tree."""
    where = torch.full((tree.lengths.numel(),), -1, dtype=torch.int64)
    where[kept] = torch.arange(kept.numel())
    segments = segment_of_row.index_select(0, step_rows)
    local = where.index_select(0, segments)
    offset = step_rows - tree.starts.index_select(0, segments)
    logical_rows = layout.starts.index_select(0, local) + offset
    positions = tree.positions.index_select(0, kept)
    # each segment's source: a token of this micro-batch's samples at the segment's first row
    sample_rows = torch.cat([torch.arange(s, e) for s, e in zip(batch.starts, batch.ends)]) if batch.samples \
        else torch.empty(0, dtype=torch.int64)
    sources = torch.zeros(kept.numel(), dtype=torch.int64)
    firsts = (offset == 0).nonzero().flatten()
    sources[local[firsts]] = sample_rows[firsts]
    members: dict[int, list[int]] = {}
    sample_of_token = torch.repeat_interleave(torch.arange(batch.samples),
                                              torch.tensor([e - s for s, e in zip(batch.starts, batch.ends)]))
    top = local.clone()
    while True:  # each token's top segment (under the root)
        up = layout.parents.index_select(0, top)
        if bool((up < 0).all()):
            break
        top = torch.where(up < 0, top, up)
    for segment, sample in torch.unique(torch.stack([top, sample_of_token]), dim=1).t().tolist():
        members.setdefault(segment, []).append(sample)
    tops = tuple((tuple(sorted(members.get(s, []))),
                  int(layout.lengths[s]) if len(members.get(s, [])) > 1 else 0)
                 for s in range(kept.numel()) if int(layout.parents[s]) < 0)
    return TreeLayout(starts=layout.starts, lengths=layout.lengths, parents=layout.parents,
                      depths=tree.depths.index_select(0, kept), positions=positions, sources=sources,
                      reach=layout.reach, tops=tops, logical_rows=logical_rows)
