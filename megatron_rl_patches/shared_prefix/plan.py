"""A micro-batch packed by shared prefix: the plan of its physical rows.

A micro-batch arrives packed as frameworks pack it, one sample after another (the *logical*
stream, `thd` with its `cu_seqlens`). Samples that share leading tokens (a GRPO group's prompt, a
multi-turn history, a privileged context) are found by value (`grouping.find_groups`) and laid out
once: the *physical* stream is, per group, `[prefix, rest_1, ..., rest_G]`, then each sample no other
shares with, whole, then padding. Causal attention makes this exact: a prefix token never sees what
follows it, so its states are the same in every sample; a remainder sees its prefix and itself,
nothing of its siblings (`segments` / `visible`). Each physical row keeps its position in its own
sample (`positions`), and every logical row has the physical row that computes it
(`logical_rows`): the prefix's last row predicts each member's first own token, one row for G
targets. The plan is data: it travels with its micro-batch as an argument (`params.plan_params`)."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_rl_patches.shared_prefix.grouping import Group, find_groups
from megatron_rl_patches.shared_prefix.plan_arguments import bounded_pad_to, hint_values, no_negative_id


@dataclass(frozen=True)
class PlanStats:
    """What a plan computes and saves: the samples' tokens as packed (`logical_tokens`) and as
    planned (`physical_tokens`, padding left out), the groups of two or more samples, the samples in
    them, the samples alone, and the claimed groups (`hints`) whose members' tokens differ (split by
    value, never merged)."""

    samples: int
    logical_tokens: int
    physical_tokens: int
    groups: int
    shared_samples: int
    alone: int
    split_hints: int = 0

    @property
    def saved_tokens(self) -> int:
        return self.logical_tokens - self.physical_tokens

    def as_dict(self) -> dict[str, int]:
        return {"samples": self.samples, "logical_tokens": self.logical_tokens,
                "physical_tokens": self.physical_tokens, "saved_tokens": self.saved_tokens,
                "groups": self.groups, "shared_samples": self.shared_samples, "alone": self.alone,
                "split_hints": self.split_hints}


@dataclass(frozen=True, eq=False)
class Block:
    """Physical rows [start, end) that attend only among themselves: a group (`causal` False: its
    `prefix` rows first, then each remainder's rows [a, b) of `rests`, each seeing the prefix and
    itself) or a sample alone, or padding (plainly causal)."""

    start: int
    end: int
    causal: bool
    prefix: int = 0
    rests: tuple[tuple[int, int], ...] = ()


@dataclass(eq=False)
class SharedPrefixPlan:
    """The physical stream of one micro-batch (CPU tensors, int64): `tokens` [S], `positions` [S]
    (each token's position in its own sample), `segments` [S] and `visible` [S] (row i sees row j <= i
    when segments[j] is segments[i] or visible[i]), `logical_rows` [T] (the physical row of each
    logical row), `logical_tokens` [T] (the stream as packed), the attention `blocks`, the `groups`
    and `stats`. Build it with :func:`plan_shared_prefix`."""

    tokens: torch.Tensor
    positions: torch.Tensor
    segments: torch.Tensor
    visible: torch.Tensor
    logical_rows: torch.Tensor
    logical_tokens: torch.Tensor
    blocks: tuple[Block, ...]
    groups: tuple[Group, ...]
    stats: PlanStats
    padding_rows: int
    _placed: dict = field(default_factory=dict, repr=False)

    @property
    def physical_length(self) -> int:
        return int(self.tokens.numel())

    @property
    def logical_length(self) -> int:
        return int(self.logical_tokens.numel())

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


def plan_shared_prefix(tokens: torch.Tensor, cu_seqlens: Any, *, samples: int | None = None, pad_to: int = 1,
                       min_shared: int = 1, hints: Sequence[Any] | None = None) -> SharedPrefixPlan:
    """The shared-prefix plan of a micro-batch packed as `tokens` ([T] or [1, T]) with sequence
    boundaries `cu_seqlens` ([n + 1], as megatron-core's `PackedSeqParams`). The first `samples`
    sequences (default: all) are samples; later sequences and the rows past `cu_seqlens[-1]` are
    padding, never shared. The physical stream is padded to a multiple of `pad_to` (the tensor-parallel
    size under sequence parallelism). Samples share a prefix of at least `min_shared` tokens. `hints`
    (one per sample, e.g. a claimed group index) only count claimed groups whose tokens differ."""
    ids = _ids(tokens)
    bounds = _bounds(cu_seqlens, ids.numel())
    n = len(bounds) - 1
    samples = n if samples is None else _count("samples", samples, 0)
    if samples > n:
        raise ValueError(f"plan_shared_prefix: samples={samples} but cu_seqlens holds {n} sequences")
    pad_to, min_shared = bounded_pad_to(_count("pad_to", pad_to, 1), ids.numel()), _count("min_shared", min_shared, 1)
    no_negative_id(ids, bounds)
    starts, ends = bounds[:samples], bounds[1:samples + 1]
    if any(end <= start for start, end in zip(starts, ends)):
        raise ValueError("plan_shared_prefix: a sample of length 0 (cu_seqlens repeats a boundary); "
                         "pack only non-empty samples")
    hints = hint_values(hints, samples)
    values = ids.tolist()
    sequences = [values[start:end] for start, end in zip(starts, ends)]
    groups = find_groups(sequences, min_shared)

    pieces_tokens: list[torch.Tensor] = []
    pieces_positions: list[torch.Tensor] = []
    pieces_segments: list[torch.Tensor] = []
    pieces_visible: list[torch.Tensor] = []
    logical_rows = torch.empty(ids.numel(), dtype=torch.int64)
    blocks: list[Block] = []
    row = segment = 0

    def lay(piece: torch.Tensor, first_position: int, visible: int | None = None) -> int:
        nonlocal row, segment
        length = piece.numel()
        pieces_tokens.append(piece)
        pieces_positions.append(torch.arange(first_position, first_position + length))
        pieces_segments.append(torch.full((length,), segment, dtype=torch.int64))
        pieces_visible.append(torch.full((length,), segment if visible is None else visible, dtype=torch.int64))
        start, row, segment = row, row + length, segment + 1
        return start

    for group in groups:
        block_start = row
        shared, prefix_segment, prefix_row = group.shared, 0, 0
        if shared:
            prefix_segment = segment
            prefix_row = lay(ids[starts[group.members[0]]:starts[group.members[0]] + shared], 0)
        rests = []
        for member in group.members:
            start, end = starts[member], ends[member]
            rest_row = lay(ids[start + shared:end], shared, prefix_segment if shared else None)
            rests.append((rest_row, row))
            if shared:
                logical_rows[start:start + shared] = torch.arange(prefix_row, prefix_row + shared)
            logical_rows[start + shared:end] = torch.arange(rest_row, rest_row + end - start - shared)
        blocks.append(Block(block_start, row, causal=not shared, prefix=shared,
                            rests=tuple(rests) if shared else ()))
    physical = row
    logical_padding = ids.numel() - (ends[-1] if ends else 0)
    needed = 1 if logical_padding else 0  # the row every logical padding row reads
    padding = needed + (-(physical + needed)) % pad_to
    if padding:
        pad_id = ids[ends[-1] if ends else 0] if logical_padding else torch.tensor(0)
        pad_row = lay(pad_id.repeat(padding).to(torch.int64), 0)
        blocks.append(Block(pad_row, row, causal=True))
        if logical_padding:
            logical_rows[ids.numel() - logical_padding:] = pad_row
    split = 0
    if hints is not None:
        group_of = {member: index for index, group in enumerate(groups) for member in group.members}
        claimed: dict[Any, set[int]] = {}
        for member, hint in enumerate(hints):
            claimed.setdefault(hint, set()).add(group_of[member])
        split = sum(1 for found in claimed.values() if len(found) > 1)
    shared_groups = [group for group in groups if group.shared]
    stats = PlanStats(samples=samples, logical_tokens=ends[-1] if ends else 0, physical_tokens=physical,
                      groups=len(shared_groups), shared_samples=sum(len(g.members) for g in shared_groups),
                      alone=sum(1 for g in groups if not g.shared), split_hints=split)

    def cat(pieces: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.int64)

    return SharedPrefixPlan(tokens=cat(pieces_tokens), positions=cat(pieces_positions), segments=cat(pieces_segments),
                            visible=cat(pieces_visible), logical_rows=logical_rows, logical_tokens=ids,
                            blocks=tuple(blocks), groups=tuple(groups), stats=stats, padding_rows=padding)
