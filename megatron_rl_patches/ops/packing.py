"""Shifted targets and per-sample response slices for packed (`thd`), CP-zigzag and allgather-CP rows.

Compute the log-probs once over the whole local ``[T, V]`` logits (one autograd node, no
per-sample copies), then slice each sample's response. Conventions (Megatron / slime): sample i
has ``total_lengths[i]`` tokens, the last ``response_lengths[i]`` of them the response; logits
row g of a sample predicts its token g + 1, so the response is predicted by rows
``[prompt - 1, total - 1)``.

Layouts of the local rows:
- no CP: samples back to back (`thd`), or each padded to ``max_seq_len`` rows (`bshd`);
- CP zigzag: each sample padded to ``2·cp·c`` rows (``c = ceil(len / (2·cp))``, len = total for
  `thd`, ``max_seq_len`` for `bshd`) and cut in ``2·cp`` chunks; rank r holds chunks r and
  ``2·cp - 1 - r``, sample after sample;
- allgather-CP (`thd` only): the packed global sequence split in contiguous ``T``-row slices.
"""
from __future__ import annotations

import itertools
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn

from megatron_rl_patches.ops.logprobs import log_probs_and_entropy
from megatron_rl_patches.ops.topk import topk_logprobs

__all__ = [
    "PackedLayout",
    "Piece",
    "response_pieces",
    "shifted_targets",
    "split_responses",
    "response_log_probs_and_entropy",
    "allgather_cp_to_zigzag",
    "zigzag_to_allgather_cp",
]
# Not in __all__ (no promise to users): packed_ids, packed_topk_logprobs and positions_mask, the
# per-sample top-k rows a host's OPD route places on packed rows (integrations' helpers).


@dataclass(frozen=True)
class Piece:
    """Local rows ``[start, stop)`` hold the response positions ``[offset, offset + stop - start)``."""

    start: int
    stop: int
    offset: int


def _whole(name: str, value: Any) -> int:
    """`value` as an int when it is a whole number type (int, numpy or 0-d integer tensor; not bool)."""
    is_bool = isinstance(value, bool) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool)
    try:
        if is_bool:
            raise TypeError
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}; pass a whole number") from None


def _lengths(name: str, values: Any) -> tuple[int, ...]:
    """Per-sample token counts from a sequence of ints or a 1-D integer tensor."""
    if isinstance(values, torch.Tensor):
        if values.dim() != 1:
            raise TypeError(f"{name} must be a 1-D integer tensor or a sequence of ints, got a tensor of shape "
                            f"{list(values.shape)}")
        values = list(values)
    elif isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise TypeError(f"{name} must be a sequence of ints (one per sample), got {type(values).__name__}")
    lengths = tuple(_whole(f"{name}[{i}]", value) for i, value in enumerate(values))
    negative = [i for i, n in enumerate(lengths) if n < 0]
    if negative:
        raise ValueError(f"{name}[{negative[0]}] must be >= 0, got {lengths[negative[0]]}")
    return lengths


def _check_rows(name: str, values: Any) -> None:
    if not isinstance(values, torch.Tensor) or values.dim() < 1:
        got = "a 0-d tensor" if isinstance(values, torch.Tensor) else type(values).__name__
        raise TypeError(f"{name} must be a tensor with one row per local token ([T, ...]), got {got}")


@dataclass(frozen=True)
class PackedLayout:
    """Where each sample's rows sit in this rank's logits. Validated on construction."""

    total_lengths: tuple[int, ...]
    response_lengths: tuple[int, ...]
    cp_size: int = 1
    cp_rank: int = 0
    allgather_cp: bool = False
    qkv_format: str = "thd"
    max_seq_len: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "total_lengths", _lengths("total_lengths", self.total_lengths))
        object.__setattr__(self, "response_lengths", _lengths("response_lengths", self.response_lengths))
        object.__setattr__(self, "cp_size", _whole("cp_size", self.cp_size))
        object.__setattr__(self, "cp_rank", _whole("cp_rank", self.cp_rank))
        if self.max_seq_len is not None:
            object.__setattr__(self, "max_seq_len", _whole("max_seq_len", self.max_seq_len))
        if not isinstance(self.allgather_cp, bool):
            raise TypeError(f"allgather_cp must be True or False, got {self.allgather_cp!r}")
        if len(self.total_lengths) != len(self.response_lengths):
            raise ValueError(
                f"total_lengths ({len(self.total_lengths)} samples) and response_lengths "
                f"({len(self.response_lengths)} samples) must describe the same samples"
            )
        for i, (total, response) in enumerate(zip(self.total_lengths, self.response_lengths)):
            if not 0 <= response <= total - 1:
                raise ValueError(
                    f"sample {i}: response_length must be in [0, total_length - 1] = [0, {total - 1}] "
                    f"(the first response token is predicted by the last prompt token), got {response}"
                )
        if self.qkv_format not in ("thd", "bshd"):
            raise ValueError(f"qkv_format must be 'thd' or 'bshd', got {self.qkv_format!r}")
        if self.cp_size < 1 or not 0 <= self.cp_rank < self.cp_size:
            raise ValueError(f"need cp_size >= 1 and 0 <= cp_rank < cp_size, got cp_rank={self.cp_rank}, "
                             f"cp_size={self.cp_size}")
        if self.allgather_cp and self.qkv_format != "thd":
            raise ValueError(
                f"allgather-CP is defined for the packed 'thd' layout only, got qkv_format={self.qkv_format!r}: "
                f"with padded samples its contiguous row split would misalign tokens; use zigzag CP "
                f"(allgather_cp=False) for 'bshd'"
            )
        if self.qkv_format == "bshd":
            longest = max(self.total_lengths, default=0)
            if self.max_seq_len is None or self.max_seq_len < longest:
                raise ValueError(
                    f"qkv_format='bshd' needs max_seq_len >= the longest sample ({longest}), got {self.max_seq_len}"
                )

    @property
    def zigzag(self) -> bool:
        return self.cp_size > 1 and not self.allgather_cp

    def zigzag_chunk(self, total_length: int) -> int:
        """Rows per CP chunk of one sample under zigzag CP."""
        length = total_length if self.qkv_format == "thd" else self.max_seq_len
        assert length is not None  # bshd packing has a max_seq_len
        return -(-length // (2 * self.cp_size))

    def sample_rows(self, total_length: int) -> int:
        """Local rows one sample occupies (no CP or zigzag CP)."""
        if self.zigzag:
            return 2 * self.zigzag_chunk(total_length)
        return total_length if self.qkv_format == "thd" else self.max_seq_len  # type: ignore[return-value]


@dataclass(frozen=True)
class _Run:
    """Local rows ``[local_start, local_start + length)`` are rows ``[sample_start, ...)`` of one
    sample, each predicting the sample's next token (so every row lies below ``total - 1``)."""

    local_start: int
    sample_start: int
    length: int


def _zigzag_halves(layout: PackedLayout, total_length: int) -> list[tuple[int, int]]:
    """(first global row in the sample, first local row relative to the sample) of both chunks."""
    chunk = layout.zigzag_chunk(total_length)
    ranks = (layout.cp_rank, 2 * layout.cp_size - 1 - layout.cp_rank)
    return [(k * chunk, half * chunk) for half, k in enumerate(ranks)]


def _check_rows_fit(layout: PackedLayout, num_rows: int) -> None:
    """The layout's rows must fit the logits: this rank's `num_rows`, or the packed sequence
    split over every CP rank under allgather-CP."""
    if layout.allgather_cp and layout.cp_size > 1:
        needed, held = sum(layout.total_lengths), layout.cp_size * num_rows
        holder = f"{layout.cp_size} CP ranks x {num_rows} local rows"
    else:
        needed, held = sum(layout.sample_rows(total) for total in layout.total_lengths), num_rows
        holder = f"{num_rows} local rows"
    if needed > held:
        raise ValueError(f"the layout needs {needed} rows but the logits hold {held} ({holder}); "
                         f"check total_lengths / cp_size / qkv_format against the model input")


def _zigzag_runs(layout: PackedLayout, total: int, base: int) -> list[_Run]:
    """This rank's two CP chunks of a sample whose local rows start at `base`."""
    chunk = layout.zigzag_chunk(total)
    runs = []
    for sample_start, local_start in _zigzag_halves(layout, total):
        stop = min(total - 1, sample_start + chunk)
        if sample_start < stop:
            runs.append(_Run(base + local_start, sample_start, stop - sample_start))
    return runs


def _contiguous_runs(total: int, base: int, first_row: int, num_rows: int) -> list[_Run]:
    """The part of a sample at packed rows ``[base, base + total - 1)`` that falls in this rank's
    rows ``[first_row, first_row + num_rows)``."""
    start, stop = max(base, first_row), min(base + total - 1, first_row + num_rows)
    return [_Run(start - first_row, start - base, stop - start)] if start < stop else []


def _sample_runs(layout: PackedLayout, num_rows: int) -> list[list[_Run]]:
    """Per sample, the local rows of this rank that predict one of its tokens: the one walk over
    the three layouts (no CP, zigzag CP, allgather-CP)."""
    num_rows = _whole("num_rows", num_rows)
    _check_rows_fit(layout, num_rows)
    allgather = layout.allgather_cp and layout.cp_size > 1
    first_row = layout.cp_rank * num_rows if allgather else 0  # first packed row this rank holds
    runs: list[list[_Run]] = []
    base = 0  # first row of the sample: local (no CP, zigzag) or packed (allgather-CP)
    for total in layout.total_lengths:
        if layout.zigzag:
            runs.append(_zigzag_runs(layout, total, base))
        else:
            runs.append(_contiguous_runs(total, base, first_row, num_rows))
        base += total if allgather else layout.sample_rows(total)
    return runs


def response_pieces(layout: PackedLayout, num_rows: int) -> list[list[Piece]]:
    """Per sample, the local row ranges holding its response log-prob rows, in response order."""
    pieces: list[list[Piece]] = []
    for runs, total, response in zip(_sample_runs(layout, num_rows), layout.total_lengths, layout.response_lengths):
        first, last = total - response - 1, total - 1  # rows of the sample that predict the response
        mine = []
        for run in runs:
            start, stop = max(first, run.sample_start), min(last, run.sample_start + run.length)
            if start < stop:
                local = run.local_start + start - run.sample_start
                mine.append(Piece(local, local + stop - start, start - first))
        pieces.append(mine)
    return pieces


def _check_sample_tokens(tokens: Sequence[torch.Tensor], layout: PackedLayout) -> None:
    if len(tokens) != len(layout.total_lengths):
        raise ValueError(f"got {len(tokens)} token tensors for {len(layout.total_lengths)} samples")
    for i, (tok, total) in enumerate(zip(tokens, layout.total_lengths)):
        if not isinstance(tok, torch.Tensor) or tok.dtype == torch.bool or tok.is_floating_point() or tok.is_complex():
            got = f"dtype {tok.dtype}" if isinstance(tok, torch.Tensor) else type(tok).__name__
            raise TypeError(f"tokens[{i}] must be an integer tensor of token ids (int64/int32), got {got}")
        if tok.dim() != 1 or tok.numel() != total:
            raise ValueError(f"sample {i}: tokens must be 1-D of total_length {total}, got shape {tuple(tok.shape)}")


def shifted_targets(
    tokens: Sequence[torch.Tensor], layout: PackedLayout, num_rows: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """Target id of every local logits row (the sample's next token; 0 where there is none)."""
    _check_sample_tokens(tokens, layout)
    num_rows = _whole("num_rows", num_rows)
    runs_per_sample = _sample_runs(layout, num_rows)
    device = device if device is not None else (tokens[0].device if len(tokens) else "cpu")
    targets = torch.zeros(num_rows, dtype=torch.long, device=device)
    for tok, runs in zip(tokens, runs_per_sample):
        for run in runs:
            targets[run.local_start : run.local_start + run.length] = (
                tok[run.sample_start + 1 : run.sample_start + run.length + 1])
    return targets


def split_responses(values: torch.Tensor, layout: PackedLayout) -> list[torch.Tensor]:
    """Per sample, this rank's response rows of a per-row tensor (``[T, ...]``), in response order."""
    _check_rows("values", values)
    out = []
    for pieces in response_pieces(layout, values.size(0)):
        parts = [values[p.start : p.stop] for p in pieces]
        out.append(parts[0] if len(parts) == 1 else torch.cat(parts) if parts else values[:0])
    return out


def response_log_probs_and_entropy(
    logits: torch.Tensor, tokens: Sequence[torch.Tensor], layout: PackedLayout, **kwargs: Any
) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """One :func:`log_probs_and_entropy` call over all local rows, sliced per sample's response.

    `kwargs` go to :func:`megatron_rl_patches.ops.logprobs.log_probs_and_entropy` (tp_group,
    temperature, with_entropy, keep_mask aligned with the local rows, ...).
    """
    _check_rows("logits", logits)
    targets = shifted_targets(tokens, layout, logits.size(0), device=logits.device)
    log_probs, entropy = log_probs_and_entropy(logits, targets, **kwargs)
    return split_responses(log_probs, layout), (split_responses(entropy, layout) if entropy is not None else None)


def allgather_cp_to_zigzag(
    values: Sequence[torch.Tensor], layout: PackedLayout, num_rows: int, group: dist.ProcessGroup | None
) -> list[torch.Tensor]:
    """Move per-sample response tensors from allgather-CP ranks to the pieces zigzag CP gives them.

    Each rank contributes its contiguous pieces, one SUM all-reduce over the CP `group` rebuilds
    every full response, and each rank keeps its zigzag pieces. Gradient flow is preserved
    exactly as it came in: if any input requires grad the all-reduce is differentiable (its
    backward sums the gradients of every rank); otherwise (metrics) a plain collective on
    detached data is used and the outputs do not require grad. Every rank must make the same
    choice, which holds when all ranks run the same code. Bool values (masks) move as integers.
    """
    mine = _allgather_pieces(layout, num_rows, group)
    _check_piece_rows("allgather-CP", values, mine)
    if layout.cp_size == 1 or not values:  # nothing to move (no samples: the same on every rank)
        return list(values)
    return _moved(values, layout, mine, _zigzag_pieces(layout), group)


def zigzag_to_allgather_cp(
    values: Sequence[torch.Tensor], layout: PackedLayout, num_rows: int, group: dist.ProcessGroup | None
) -> list[torch.Tensor]:
    """The inverse of :func:`allgather_cp_to_zigzag`: per-sample tensors on this rank's zigzag
    pieces go to its allgather-CP pieces of `num_rows` local rows (one SUM all-reduce)."""
    mine = _allgather_pieces(layout, num_rows, group)
    zigzag = _zigzag_pieces(layout)
    _check_piece_rows("zigzag", values, zigzag)
    if layout.cp_size == 1 or not values:
        return list(values)
    return _moved(values, layout, zigzag, mine, group)


def _allgather_pieces(layout: PackedLayout, num_rows: int, group: dist.ProcessGroup | None) -> list[list[Piece]]:
    """This rank's allgather-CP pieces per sample, the layout checked against the CP `group`."""
    if not layout.allgather_cp:
        raise ValueError("moving rows between allgather-CP and zigzag needs a layout with allgather_cp=True")
    cp_size = 1 if group is None else dist.get_world_size(group)
    if cp_size != layout.cp_size:
        raise ValueError(f"layout.cp_size={layout.cp_size} but the CP group has {cp_size} ranks")
    return response_pieces(layout, num_rows)


def _zigzag_pieces(layout: PackedLayout) -> list[list[Piece]]:
    """This rank's zigzag CP pieces per sample for the samples of an allgather-CP `layout`."""
    zigzag = PackedLayout(layout.total_lengths, layout.response_lengths, cp_size=layout.cp_size,
                          cp_rank=layout.cp_rank, qkv_format=layout.qkv_format)
    return response_pieces(zigzag, sum(zigzag.sample_rows(t) for t in layout.total_lengths))


def _check_piece_rows(kind: str, values: Sequence[torch.Tensor], pieces: list[list[Piece]]) -> None:
    """One tensor per sample with as many rows as its `kind` pieces on this rank."""
    if len(values) != len(pieces):
        raise ValueError(f"got {len(values)} tensors for {len(pieces)} samples")
    for i, (value, held) in enumerate(zip(values, pieces)):
        rows = sum(p.stop - p.start for p in held)
        if value.size(0) != rows:
            raise ValueError(f"sample {i}: expected {rows} rows on this rank (its {kind} pieces), got {value.size(0)}")


def _moved(
    values: Sequence[torch.Tensor], layout: PackedLayout, sources: list[list[Piece]], targets: list[list[Piece]],
    group: dist.ProcessGroup | None,
) -> list[torch.Tensor]:
    """Every full response rebuilt on every rank from each rank's `sources` pieces; this rank's `targets`."""
    if values[0].dtype == torch.bool:  # a SUM of bools is not every backend's; each row is set on one rank
        return [moved != 0 for moved in _moved([v.to(torch.int32) for v in values], layout, sources, targets, group)]
    starts = [0, *itertools.accumulate(layout.response_lengths)]
    flat = torch.cat(list(values))
    device, trailing = flat.device, tuple(flat.shape[1:])

    def positions(pieces_per_sample: list[list[Piece]]) -> torch.Tensor:
        idx = [torch.arange(starts[i] + p.offset, starts[i] + p.offset + p.stop - p.start)
               for i, pieces in enumerate(pieces_per_sample) for p in pieces]
        return (torch.cat(idx) if idx else torch.zeros(0, dtype=torch.long)).to(device)

    full = flat.new_zeros((starts[-1], *trailing)).index_put((positions(sources),), flat)
    # SUM all-reduce over the CP group: each response row is nonzero on exactly one rank (the
    # one holding it in the source layout), so the sum is every full response on every rank
    if full.requires_grad:  # some input requires grad

        full = dist_nn.all_reduce(full, group=group)
    else:
        dist.all_reduce(full, group=group)
    picked = full[positions(targets)]
    sizes = [sum(p.stop - p.start for p in pieces) for pieces in targets]
    return list(picked.split(sizes))


def packed_ids(per_sample: list[torch.Tensor], positions: list[torch.Tensor], length: int,
               dtype: torch.dtype = torch.long) -> torch.Tensor:
    """[T, k] ids on the packed rows from per-sample [R_i, k] (rows outside responses: id 0); with
    `dtype=torch.bool`, an ids mask the same way (rows outside responses: False)."""
    if len(per_sample) != len(positions):
        raise ValueError(f"top-k ids for {len(per_sample)} samples, the micro-batch has {len(positions)}")
    k = per_sample[0].shape[-1]
    device = positions[0].device
    ids = torch.zeros(length, k, dtype=dtype, device=device)
    for sample, rows in zip(per_sample, positions):
        if sample.shape != (rows.numel(), k):
            raise ValueError(f"top-k ids of shape {tuple(sample.shape)} for a response of {rows.numel()} tokens "
                             f"(expected [{rows.numel()}, {k}])")
        ids[rows] = sample.to(device=device, dtype=dtype)
    return ids


def packed_topk_logprobs(rows: torch.Tensor, ids: list[torch.Tensor], masks: list[torch.Tensor] | None,
                         positions: list[torch.Tensor], **options: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """`topk_logprobs` of packed [T, V] logits `rows` at per-sample ids ([R_i, k] each, with their
    bool `masks` or None) placed on each sample's response `positions` (`packed_ids`): only those
    rows are scored (the other rows' ids are placeholders, 0, never read). `options`:
    `topk_logprobs`' own (tp_group, temperature, invariant)."""
    length = rows.shape[0]
    mask = None if masks is None else packed_ids(masks, positions, length, dtype=torch.bool)
    return topk_logprobs(rows, packed_ids(ids, positions, length), ids_mask=mask,
                         row_mask=positions_mask(positions, length, rows.device), **options)


def positions_mask(positions: list[torch.Tensor], length: int, device: Any) -> torch.Tensor:
    """[length] bool: True at every row of `positions` (per sample, its row indices)."""
    rows = torch.zeros(length, dtype=torch.bool, device=device)
    if positions:
        rows[torch.cat(positions)] = True
    return rows
