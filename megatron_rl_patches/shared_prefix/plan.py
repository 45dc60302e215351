"""A micro-batch packed by shared prefix: the plan of its physical rows.

A micro-batch arrives packed as frameworks pack it, one sample after another (the *logical*
stream, `thd` with its `cu_seqlens`). Every run of leading tokens two or more samples share (a GRPO
group's prompt, a multi-turn history at each turn where it branches, a privileged context before
every prompt) is found by value and laid out once (`tree.tree_layout`: the samples' trie in
segments, each segment after its parent, its children after it), then the padding as megatron-core
packs it (`padding`: each padding sequence on rows of its own, each row its own, since the MoE
statistics and the MTP loss count every padding row by its own id), then the rows padding the stream
to a multiple. Causal attention
makes this exact: a token never sees what follows it, so a shared token's states are the same in
every sample holding it; a segment sees its ancestors and itself causally, nothing of its siblings
(`segments` / `reach`, the one rule of `attention_rule`). Each physical row keeps its position in
its own sample (`positions`), and every logical row has the physical row that computes it
(`logical_rows`): a branch point's last row predicts each child's first token, one row for several
targets. The plan is data: it travels with its micro-batch as an argument, in the `packed_seq_params`
megatron-core hands down every call (`shared_prefix_plan_of` reads it back there)."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_rl_patches.shared_prefix.grouping import Group
from megatron_rl_patches.shared_prefix.padding import padding_layout
from megatron_rl_patches.shared_prefix.plan_arguments import bounded_pad_to, hint_values, no_negative_id
from megatron_rl_patches.shared_prefix.plan_summary import PrefixNode, plan_summary, plan_tree
from megatron_rl_patches.shared_prefix.routed_experts import (
    diverging_samples,
    padding_alike,
    route_keys,
    say_what_routes_cost,
)
from megatron_rl_patches.shared_prefix.tree import TreeLayout, run_of, tree_layout


@dataclass(frozen=True)
class PlanStats:
    """What a plan computes and saves: the samples' tokens as packed (`logical_tokens`) and as
    planned (`physical_tokens`, padding left out), the groups of two or more samples, the samples in
    them, the samples alone, the claimed groups (`hints`) whose members' tokens differ (split by
    value, never merged), and what the padding costs: its rows as packed (`padding_tokens`: the
    sequences past the samples and the rows past `cu_seqlens[-1]`), the physical rows computing them
    (`padding_rows`: each its own, as the packed path computes it, or one per padding sequence of
    one repeated id where the caller asked it: `padding.padding_layout`) and the rows that pad the
    stream to a multiple (`filler_rows`, read by nothing). The physical stream is `physical_tokens +
    padding_rows + filler_rows` rows."""

    samples: int
    logical_tokens: int
    physical_tokens: int
    groups: int
    shared_samples: int
    alone: int
    split_hints: int = 0
    padding_tokens: int = 0
    padding_rows: int = 0
    filler_rows: int = 0

    @property
    def saved_tokens(self) -> int:
        return self.logical_tokens - self.physical_tokens

    def as_dict(self) -> dict[str, int]:
        return {"samples": self.samples, "logical_tokens": self.logical_tokens,
                "physical_tokens": self.physical_tokens, "saved_tokens": self.saved_tokens,
                "groups": self.groups, "shared_samples": self.shared_samples, "alone": self.alone,
                "split_hints": self.split_hints, "padding_tokens": self.padding_tokens,
                "padding_rows": self.padding_rows, "filler_rows": self.filler_rows}


@dataclass(eq=False)
class SharedPrefixPlan:
    """The physical stream of one micro-batch (CPU tensors, int64): `tokens` [S], `positions` [S]
    (each token's position in its own sample), `segments` [S] (each row's segment) and `reach` [S]
    (the end of the rows of its segment's subtree: row i attends row j exactly when j <= i < reach[j],
    `attention_rule.sees`), per segment its first row `segment_starts`, its parent
    `segment_parents` (-1 under the root) and `segment_depths` (0 under the root), `logical_rows` [T]
    (the physical row of each logical row), `logical_tokens` [T] (the stream as packed), the `groups`
    (the samples' subtrees under the root), `stats`, `padding_rows` (the physical rows after the
    samples': the padding's and the filler's, `stats.padding_rows + stats.filler_rows`), and the
    `cu_seqlens` it was built from (`sequence_bounds`: where context parallelism cuts the logical ids
    per sequence, and megatron-core's MTP rolls them). Build it with :func:`plan_shared_prefix`."""

    tokens: torch.Tensor
    positions: torch.Tensor
    segments: torch.Tensor
    reach: torch.Tensor
    segment_starts: torch.Tensor
    segment_parents: torch.Tensor
    segment_depths: torch.Tensor
    logical_rows: torch.Tensor
    logical_tokens: torch.Tensor
    groups: tuple[Group, ...]
    stats: PlanStats
    padding_rows: int
    sequence_bounds: torch.Tensor = field(default_factory=lambda: torch.zeros(1, dtype=torch.int64))
    # rows a step's held segments hold (`held.HeldRows`): None where the plan computes every row itself
    held: Any = None
    _placed: dict = field(default_factory=dict, repr=False)

    @property
    def physical_length(self) -> int:
        return int(self.tokens.numel())

    @property
    def logical_length(self) -> int:
        return int(self.logical_tokens.numel())

    @property
    def segment_ends(self) -> torch.Tensor:
        """Each segment's end row (its rows: [segment_starts[s], segment_ends[s]))."""
        return torch.cat([self.segment_starts[1:], torch.tensor([self.physical_length])])

    @property
    def longest(self) -> int:
        """The longest sample's length (positions run below it): the rotary table a forward needs."""
        return int(self.positions.max()) + 1 if self.positions.numel() else 1

    def cached(self, key: tuple, build: Callable[[], Any]) -> Any:
        """`build()`, made once per plan and `key` (a tensor moved to a device, a mask), then kept."""
        if key not in self._placed:
            self._placed[key] = build()
        return self._placed[key]

    def on(self, device: Any, name: str) -> torch.Tensor:
        """The plan's tensor `name` on `device` (moved once per device, then kept)."""
        device = torch.device(device)
        return self.cached((name, str(device)), lambda: getattr(self, name).to(device))

    def fingerprint(self) -> tuple[int, int, int]:
        """(physical rows, logical rows, a checksum of both maps): what the ranks of a group agree on."""
        weights = torch.arange(1, self.physical_length + 1, dtype=torch.int64)
        rows = torch.arange(1, self.logical_length + 1, dtype=torch.int64)
        checksum = int(((self.tokens + 7 * self.positions) * weights).sum() + (self.logical_rows * rows).sum())
        return self.physical_length, self.logical_length, checksum % (2 ** 52)

    def __repr__(self) -> str:
        """One line of figures, not the tensors (`print(plan)`): the samples sharing and alone, the
        tokens packed and computed, the padding rows, the segments at each depth."""
        return plan_summary(self)

    def tree(self) -> tuple[PrefixNode, ...]:
        """The segments as trees under the root, at every depth (`groups`: the top level only): each
        `PrefixNode`'s rows, the samples holding it, the segments under it; `print(node)` draws one."""
        return plan_tree(self)


def _ids(tokens: Any) -> torch.Tensor:
    if not isinstance(tokens, torch.Tensor):
        raise TypeError(f"plan_shared_prefix: tokens must be a torch.Tensor of ids, got {type(tokens).__name__}")
    if tokens.dim() == 2 and tokens.size(0) == 1:
        tokens = tokens[0]
    if tokens.dim() != 1 or tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
        raise ValueError("plan_shared_prefix: tokens must be the packed ids, [T] or [1, T] of an integer dtype, got "
                         f"{tuple(tokens.shape)} {tokens.dtype}")
    if tokens.device.type == "meta":
        raise ValueError("plan_shared_prefix: tokens are on the meta device (no values to group by)")
    return tokens.detach().to("cpu", torch.int64)


def _bounds(cu_seqlens: Any, length: int) -> list[int]:
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1 or cu_seqlens.dtype.is_floating_point or cu_seqlens.device.type == "meta":
            raise ValueError("plan_shared_prefix: cu_seqlens must be a 1-D integer tensor of sequence boundaries, got "
                             f"{tuple(cu_seqlens.shape)} {cu_seqlens.dtype} on {cu_seqlens.device}")
        cu_seqlens = cu_seqlens.tolist()
    if not isinstance(cu_seqlens, Sequence) or not all(isinstance(x, int) and not isinstance(x, bool)
                                                        for x in cu_seqlens):
        raise TypeError("plan_shared_prefix: cu_seqlens must be a tensor or a sequence of ints")
    bounds = list(cu_seqlens)
    if len(bounds) < 1 or bounds[0] != 0 or any(b > a for a, b in zip(bounds[1:], bounds)) or bounds[-1] > length:
        raise ValueError(f"plan_shared_prefix: cu_seqlens must start at 0, never decrease and end within the {length} "
                         f"packed tokens, got {bounds[:8]}{'...' if len(bounds) > 8 else ''}")
    return bounds


def _count(name: str, value: Any, low: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"plan_shared_prefix: {name} must be an int >= {low}, got {value!r}")
    return value


@dataclass(frozen=True)
class MicroBatch:
    """A packed micro-batch's arguments, checked: its ids (int64 on the CPU), its sequence `bounds`
    and how many of its sequences are `samples` (the rest, and the rows past the last bound, padding)."""

    ids: torch.Tensor
    bounds: list[int]
    samples: int

    @property
    def starts(self) -> list[int]:
        return self.bounds[:self.samples]

    @property
    def ends(self) -> list[int]:
        return self.bounds[1:self.samples + 1]


def checked_micro_batch(tokens: torch.Tensor, cu_seqlens: Any, samples: int | None = None) -> MicroBatch:
    """`plan_shared_prefix`'s micro-batch arguments checked and read by value (see there)."""
    ids = _ids(tokens)
    bounds = _bounds(cu_seqlens, ids.numel())
    n = len(bounds) - 1
    samples = n if samples is None else _count("samples", samples, 0)
    if samples > n:
        raise ValueError(f"plan_shared_prefix: samples={samples} but cu_seqlens holds {n} sequences")
    no_negative_id(ids, bounds)
    batch = MicroBatch(ids, bounds, samples)
    if any(end <= start for start, end in zip(batch.starts, batch.ends)):
        raise ValueError("plan_shared_prefix: a sample of length 0 (cu_seqlens repeats a boundary); "
                         "pack only non-empty samples")
    return batch


def plan_shared_prefix(tokens: torch.Tensor, cu_seqlens: Any, *, samples: int | None = None, pad_to: int = 1,
                       min_shared: int = 1, hints: Sequence[Any] | None = None,
                       levels: int | None = None, repeated_padding_once: bool = False,
                       routed_experts: Any = None) -> SharedPrefixPlan:
    """The shared-prefix plan of a micro-batch packed as `tokens` ([T] or [1, T]) with sequence
    boundaries `cu_seqlens` ([n + 1], as megatron-core's `PackedSeqParams`). The first `samples`
    sequences (default: all) are samples; later sequences and the rows past `cu_seqlens[-1]` (one
    more sequence) are padding, computed as megatron-core's packed path computes them: never shared,
    each row on a physical row of its own at its position in its sequence, seeing its sequence's
    earlier rows (`padding.padding_layout`); `repeated_padding_once`: a padding sequence of one
    repeated id computed on one row, for a model that computes every row of such a run alike
    (`repeated_padding_alike(model)`; the doors ask it). The physical stream is padded to a multiple of
    `pad_to` (the tensor-parallel size under sequence parallelism). Every run of leading tokens
    samples share is computed once, at any depth (a tree: a branch point's last row serves each
    child), where the run adds at least `min_shared` tokens to the shared segment above it (else its
    tokens go down into each child);
    `levels` caps the shared segments on a sample's path (1: a group's longest common prefix, then
    each member's rest whole). `hints` (one per sample, e.g. a claimed group index) only count
    claimed groups whose tokens differ. `routed_experts`: the MoE experts replayed for these tokens (megatron-core's
    routing replay, the rollout's recorded experts; each layer's [T, topk] as
    `RouterReplay.set_replay_data` takes them, or one [T, layers, topk] tensor): samples share only
    the rows where their ids and every layer's recorded experts agree (`routed_experts`)."""
    batch = checked_micro_batch(tokens, cu_seqlens, samples)
    pad_to, min_shared = _count("pad_to", pad_to, 1), _count("min_shared", min_shared, 1)
    hints = hint_values(hints, batch.samples)
    if levels is not None:
        _count("levels", levels, 1)
    if not isinstance(repeated_padding_once, bool):
        raise TypeError(f"plan_shared_prefix: repeated_padding_once must be a bool, got {repeated_padding_once!r}")
    if routed_experts is None:
        tree = tree_layout(batch.ids, batch.starts, batch.ends, min_shared, levels)
        return plan_of_layout(batch, tree, pad_to, hints, repeated_padding_once)
    keys = route_keys(batch.ids, routed_experts)
    tree = tree_layout(keys, batch.starts, batch.ends, min_shared, levels)
    by_ids = tree_layout(batch.ids, batch.starts, batch.ends, min_shared, levels)
    say_what_routes_cost(by_ids.rows, tree.rows, diverging_samples(by_ids.logical_rows, tree.logical_rows,
                                                                   batch.starts, batch.ends))
    repeated_padding_once = repeated_padding_once and padding_alike(keys, batch.ids, batch.bounds, batch.samples)
    return plan_of_layout(batch, tree, pad_to, hints, repeated_padding_once)


def plan_of_layout(batch: MicroBatch, tree: TreeLayout, pad_to: int = 1, hints: list[Any] | None = None,
                   repeated_padding_once: bool = False, held_rows: int = 0, at_least: int = 0) -> SharedPrefixPlan:
    """The plan of `batch` laid out as `tree` (its samples' segments), its padding as
    `plan_shared_prefix` lays it out, so that the rows the model computes (all but `held_rows`, which
    a step's held segments hold) are a multiple of `pad_to`, and at least `at_least` (a step's ranks
    that compute their passes together; at least a row where every other is held)."""
    ids, bounds, samples = batch.ids, batch.bounds, batch.samples
    pad_to = bounded_pad_to(pad_to, ids.numel())
    groups = tuple(Group(members, shared) for members, shared in tree.tops)
    physical = tree.rows
    samples_end = bounds[samples]
    padding = padding_layout(ids, bounds, samples, physical - held_rows, pad_to, repeated_padding_once,
                             max(at_least, pad_to if held_rows else 0))
    # the padding after the samples' rows (`padding.padding_layout`): each sequence a segment of its own
    starts_x = physical + padding.lengths.cumsum(0) - padding.lengths
    zeros = torch.zeros_like(padding.lengths)
    starts_t, lengths_t = torch.cat([tree.starts, starts_x]), torch.cat([tree.lengths, padding.lengths])
    positions_t, sources_t = torch.cat([tree.positions, zeros]), torch.cat([tree.sources, padding.sources])
    reach_t = torch.cat([tree.reach, starts_x + padding.lengths])
    parents, depths = torch.cat([tree.parents, zeros - 1]), torch.cat([tree.depths, zeros])
    segments = run_of(lengths_t)
    local = torch.arange(segments.numel()) - starts_t[segments]
    positions = positions_t[segments] + local
    source = sources_t[segments] + local
    # the filler rows read any id here (set below): a filler longer than the stream reads past its end otherwise
    tokens = ids[source.clamp(0, ids.numel() - 1)] if source.numel() else torch.empty(0, dtype=torch.int64)
    if padding.filler:
        tokens[physical + padding.rows - padding.filler:] = padding.filler_id
    logical_rows = torch.empty(ids.numel(), dtype=torch.int64)
    logical_rows[:tree.logical_rows.numel()] = tree.logical_rows
    logical_rows[samples_end:] = physical + padding.logical_rows
    split = 0
    if hints is not None:
        group_of = {member: index for index, group in enumerate(groups) for member in group.members}
        claimed: dict[Any, set[int]] = {}
        for member, hint in enumerate(hints):
            claimed.setdefault(hint, set()).add(group_of[member])
        split = sum(1 for found in claimed.values() if len(found) > 1)
    shared_groups = [group for group in groups if group.shared]
    stats = PlanStats(samples=samples, logical_tokens=samples_end, physical_tokens=physical,
                      groups=len(shared_groups), shared_samples=sum(len(g.members) for g in shared_groups),
                      alone=sum(1 for g in groups if not g.shared), split_hints=split,
                      padding_tokens=padding.tokens, padding_rows=padding.rows - padding.filler,
                      filler_rows=padding.filler)
    return SharedPrefixPlan(tokens=tokens, positions=positions, segments=segments, reach=reach_t[segments],
                            segment_starts=starts_t, segment_parents=parents, segment_depths=depths,
                            logical_rows=logical_rows, logical_tokens=ids, groups=groups, stats=stats,
                            padding_rows=padding.rows,
                            sequence_bounds=torch.tensor(bounds, dtype=torch.int64))


def shared_prefix_plan_of(packed_seq_params: Any) -> SharedPrefixPlan | None:
    """The plan a `packed_seq_params` carries, or None (ordinary packing, or none)."""
    plan = getattr(packed_seq_params, "shared_prefix", None)
    return plan if isinstance(plan, SharedPrefixPlan) else None


def physical_readers(plan: SharedPrefixPlan, device: Any) -> torch.Tensor:
    """[S]: a logical row that reads each physical row (0 for the padding none reads), on `device` (cached)."""
    def build() -> torch.Tensor:
        rows = torch.zeros(plan.physical_length, dtype=torch.int64)
        rows[plan.logical_rows] = torch.arange(plan.logical_length)
        return rows.to(device)

    return plan.cached(("physical-readers", str(torch.device(device))), build)
