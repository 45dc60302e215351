"""The rows one call computes (`row_mask=` of every vocabulary op), selected once per call.

:class:`RowSelection` checks the mask, reads the selected rows with one host sync and, under
tensor parallelism, checks with one collective that every rank selected the same rows (the ops
reduce per-row values over the ranks: different rows would mix unrelated tokens, or hang).
An op builds it from its `row_mask`; a processor running several ops builds it once and passes
the object as their `row_mask` (:meth:`RowSelection.of` returns it as given), so one forward
pays one host sync and one collective. The helpers below place per-row values in and out of the
selection; `rows=None` stands for every row.
"""
from __future__ import annotations

from typing import TypeVar, cast, overload

import torch
import torch.distributed as dist

from megatron_rl_patches.ops._dist import all_gather_last_dim, tp_size

_Ids = TypeVar("_Ids")

# splitmix64's constants as signed int64 (torch's integer arithmetic wraps modulo 2**64)
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_MIX_1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX_2 = 0x94D049BB133111EB - (1 << 64)
_SEEDS = (0, 0x5851F42D4C957F2D)  # two independent hashes of each index


class RowSelection:
    """The selected rows of one call: `mask` (bool [n_rows], or None: every row), `rows` (their
    indices, int64 ascending, or None), for `n_rows` rows on the tensor-parallel `group`."""

    __slots__ = ("mask", "rows", "n_rows", "group")

    def __init__(self, mask: torch.Tensor | None, n_rows: int, group: dist.ProcessGroup | None = None) -> None:
        self.mask, self.n_rows, self.group = mask, n_rows, group
        self.rows = None if mask is None else _selected(mask, group)

    @classmethod
    def of(cls, row_mask: object, n_rows: int, device: torch.device, holder: str,
           group: dist.ProcessGroup | None = None) -> RowSelection:
        """The selection of `row_mask` (None, a bool [n_rows] tensor on `device`: `holder` names
        the tensor whose rows it selects), or `row_mask` itself when it is one already built
        for the same rows, device and group."""
        if isinstance(row_mask, RowSelection):
            row_mask.require(n_rows, device, group)
            return row_mask
        return cls(check_row_mask(row_mask, n_rows, device, holder), n_rows, group)

    def require(self, n_rows: int, device: torch.device, group: dist.ProcessGroup | None) -> None:
        """A selection built for another call's rows, device or group is refused (ValueError)."""
        device_ok = self.mask is None or self.mask.device == device
        if self.n_rows != n_rows or not device_ok or self.group is not group:
            raise ValueError(f"row_mask was selected for {self.n_rows} rows on another device or tensor-parallel "
                             f"group than this call's {n_rows} rows; pass the [T] bool mask itself")

    @overload
    def take(self, value: torch.Tensor) -> torch.Tensor: ...

    @overload
    def take(self, value: None) -> None: ...

    def take(self, value: torch.Tensor | None) -> torch.Tensor | None:
        return take_rows(value, self.rows)

    def take_values(self, value: float | torch.Tensor) -> float | torch.Tensor:
        return take_row_values(value, self.rows)

    def scatter(self, values: torch.Tensor) -> torch.Tensor:
        return scatter_rows(values, self.rows, self.n_rows)


def mask_of(row_mask: object) -> object:
    """The bool mask a `row_mask` argument carries (a built selection's mask), for checks that
    run before the selection is built."""
    return row_mask.mask if isinstance(row_mask, RowSelection) else row_mask


def check_row_mask(row_mask: object, n_rows: int, device: torch.device, holder: str) -> torch.Tensor | None:
    """None, or the rows an op computes: a bool tensor [T] on `device` (`holder` names the tensor
    whose rows it selects). Returned as given; nothing is copied."""
    if row_mask is None:
        return None
    if not isinstance(row_mask, torch.Tensor) or row_mask.dtype != torch.bool:
        got = f"dtype {row_mask.dtype}" if isinstance(row_mask, torch.Tensor) else type(row_mask).__name__
        raise TypeError(f"row_mask must be a bool tensor [T] (True: compute this row), got {got}; "
                        f"build it with e.g. response_mask.bool()")
    if row_mask.shape != (n_rows,):
        raise ValueError(f"row_mask must have shape [T] = ({n_rows},), one flag per row of {holder}, "
                         f"got {tuple(row_mask.shape)}; flatten [b, s] masks with row_mask.reshape(-1)")
    if row_mask.device != device:
        raise ValueError(f"row_mask is on {row_mask.device} but {holder} on {device}; move them together")
    return row_mask


def _selected(mask: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The indices of `mask`'s rows; under tensor parallelism first checked equal on every rank."""
    if tp_size(group) <= 1:
        return torch.nonzero(mask).squeeze(1)  # the host sync: the count sets the shapes
    mine = fingerprint(mask)
    # every rank's fingerprint on every rank (one all-gather), so each rank sees a disagreement
    every = all_gather_last_dim(mine, group).reshape(-1, mine.numel())
    differs = (every != mine).any()
    count, disagree = torch.stack([mine[0], differs.to(torch.int64)]).tolist()  # the one host sync
    if disagree:
        raise ValueError("row_mask differs across the tensor-parallel ranks (its count or rows); pass the same "
                         "[T] mask on every rank of tp_group (under sequence parallelism: over the gathered rows)")
    return torch.nonzero_static(mask, size=count).squeeze(1)


def fingerprint(mask: torch.Tensor) -> torch.Tensor:
    """int64 [3]: the number of selected rows and two sums, modulo 2**64, of a 64-bit mixing hash
    (splitmix64's finalizer) of each selected index. Masks with another count or other rows give
    another fingerprint except with probability ~2**-128 (no linear relation between the indices,
    such as {0, 4} and {1, 3}, cancels a mixing hash)."""
    index = torch.arange(mask.numel(), dtype=torch.int64, device=mask.device)
    sums = [torch.where(mask, splitmix64(index ^ seed), 0).sum() for seed in _SEEDS]
    return torch.stack([mask.sum(dtype=torch.int64), *sums])


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's output function on int64 tensors (wrapping arithmetic, logical shifts)."""
    z = x + _GOLDEN
    z = (z ^ _shr(z, 30)) * _MIX_1
    z = (z ^ _shr(z, 27)) * _MIX_2
    return z ^ _shr(z, 31)


def _shr(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> on signed integers is arithmetic)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


@overload
def take_rows(value: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor: ...


@overload
def take_rows(value: None, rows: torch.Tensor | None) -> None: ...


def take_rows(value: torch.Tensor | None, rows: torch.Tensor | None) -> torch.Tensor | None:
    """`value`'s selected rows (dim 0); `value` as is when it is None or every row is selected."""
    if value is None or rows is None:
        return value
    return value.index_select(0, rows)


def take_row_values(value: float | torch.Tensor, rows: torch.Tensor | None) -> float | torch.Tensor:
    """A per-row argument (a temperature: a float, a 0-d or a [T] tensor) for the selected rows."""
    if rows is None or not isinstance(value, torch.Tensor) or value.dim() == 0 or value.numel() == 1:
        return value
    return value.reshape(-1).index_select(0, rows)


def unselected_as(ids: _Ids, row_mask: object) -> _Ids:
    """`ids` [T] or [T, k] with the unselected rows' entries replaced by valid distinct ids (0..k-1:
    those rows are never computed, so their targets need not be ids); `ids` as given when either
    argument is not a well-formed tensor yet (the op's checks then name it)."""
    row_mask = mask_of(row_mask)
    if not (isinstance(ids, torch.Tensor) and isinstance(row_mask, torch.Tensor) and row_mask.dtype == torch.bool
            and ids.dim() in (1, 2) and row_mask.shape == ids.shape[:1] and row_mask.device == ids.device):
        return ids
    if ids.dim() == 1:
        return cast(_Ids, ids.masked_fill(~row_mask, 0))
    return cast(_Ids, torch.where(row_mask[:, None], ids, torch.arange(ids.size(1), device=ids.device).to(ids.dtype)))


def scatter_rows(values: torch.Tensor, rows: torch.Tensor | None, n_rows: int) -> torch.Tensor:
    """[n_rows, ...] zeros with `values` [n, ...] at `rows` (differentiable in `values`: the
    unselected rows get no gradient); `values` as is when every row is selected."""
    if rows is None:
        return values
    return values.new_zeros((n_rows, *values.shape[1:])).index_copy(0, rows, values)
