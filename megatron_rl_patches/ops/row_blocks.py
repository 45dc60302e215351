"""Per-row math in blocks of a fixed row count: the invariant mode's finalize steps.

An elementwise op's result for one element can depend on where the element sits in its tensor
(on CPU a vectorized loop's remainder and each thread's share take another code path, with
other roundings), so a row's value could depend on how many rows surround it. Run in blocks of a
fixed shape (padded with copies of the first row), every row takes the same path whatever T.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

import torch

# elements per block: below the CPU's parallel grain (32768, so one thread runs it) and a
# multiple of every vector width (so no loop remainder)
BLOCK_ELEMENTS = 16384
MIN_BLOCK_ROWS = 64

T = TypeVar("T")


def block_rows(width: int) -> int:
    """Rows per block for per-row tensors of `width` elements a row (a multiple of 64)."""
    return max(MIN_BLOCK_ROWS, BLOCK_ELEMENTS // max(1, width) // MIN_BLOCK_ROWS * MIN_BLOCK_ROWS)


def _width(value: Any, n_rows: int) -> int:
    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.size(0) == n_rows:
        return max(1, value[0].numel())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return max([1] + [_width(getattr(value, f.name), n_rows) for f in dataclasses.fields(value)])
    if isinstance(value, (tuple, list)):
        return max([1] + [_width(v, n_rows) for v in value])
    return 1


def _map_rows(value: Any, n_rows: int, rows_fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """`value` with `rows_fn` applied to each per-row tensor (leading dim `n_rows`) inside it,
    through dataclasses, tuples and lists; anything else as it is."""
    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.size(0) == n_rows:
        return rows_fn(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(value, **{f.name: _map_rows(getattr(value, f.name), n_rows, rows_fn)
                                             for f in dataclasses.fields(value)})
    if isinstance(value, (tuple, list)):
        return type(value)(_map_rows(v, n_rows, rows_fn) for v in value)
    return value


def _pad(value: Any, n_rows: int, total: int) -> Any:
    """Per-row tensors (leading dim `n_rows`) padded to `total` rows with copies of row 0."""
    if total == n_rows:
        return value
    return _map_rows(value, n_rows, lambda t: torch.cat([t, t[:1].expand(total - n_rows, *t.shape[1:])]))


def _take(value: Any, total: int, rows: slice) -> Any:
    return _map_rows(value, total, lambda t: t[rows])


def _merge(parts: list[Any], n_rows: int) -> Any:
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(parts)[:n_rows] if first.dim() > 0 else first
    if dataclasses.is_dataclass(first) and not isinstance(first, type):
        return dataclasses.replace(first, **{f.name: _merge([getattr(p, f.name) for p in parts], n_rows)
                                             for f in dataclasses.fields(first)})
    if isinstance(first, (tuple, list)):
        return type(first)(_merge([p[i] for p in parts], n_rows) for i in range(len(first)))
    return first


def in_row_blocks(fn: Callable[..., T], n_rows: int, *args: Any) -> T:
    """``fn(*args)`` computed block by block over the rows: every tensor in `args` (also inside
    dataclasses, tuples) whose leading dim is `n_rows` is cut into blocks of a fixed row count;
    the results (tensors, dataclasses or tuples of them, None) are put back together."""
    if n_rows == 0:
        return fn(*args)
    rows = block_rows(max(_width(a, n_rows) for a in args))
    total = -(-n_rows // rows) * rows
    padded = [_pad(a, n_rows, total) for a in args]
    parts = [fn(*[_take(a, total, slice(b, b + rows)) for a in padded]) for b in range(0, total, rows)]
    return _merge(parts, n_rows)
