"""Integer arguments of the cross-tokenizer functions checked by name: token ids and student token
indices (a list, tuple or 1-D integer tensor / array of ints; never floats, strings, booleans or
None, which would be truncated or parsed silently)."""
from __future__ import annotations

import numbers
from collections.abc import Sequence, Set
from typing import Any

import numpy as np

__all__ = ["as_index_list", "as_int_array", "as_int_list", "is_int"]


def is_int(value: object) -> bool:
    """An integer (a Python or NumPy int; a bool is not)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def as_int_list(ids: Any, name: str = "ids", what: str = "token ids") -> list[int]:
    """ids (a list, tuple, or 1-D integer tensor / array) as a list of ints; the caller's object
    unchanged. A TypeError / ValueError names `name` and what to pass."""
    if hasattr(ids, "tolist") and hasattr(ids, "dtype"):
        if getattr(ids, "ndim", 1) != 1:
            raise ValueError(f"{name} must be 1-D (one sample's {what}), got shape {tuple(ids.shape)}")
        if "int" not in str(ids.dtype):
            raise TypeError(f"{name} must hold integer {what}, got dtype {ids.dtype}; pass a 1-D integer tensor "
                            "or a list of ints")
        return list(ids.tolist())
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
        raise TypeError(f"{name} must be a sequence of {what} (a list of ints or a 1-D integer tensor), "
                        f"got {type(ids).__name__}")
    if all(type(i) is int for i in ids):
        return list(ids)
    for k, i in enumerate(ids):
        if not is_int(i):
            raise TypeError(f"{name}[{k}] is {type(i).__name__} {i!r}: {name} must hold {what} as ints (a list of "
                            "ints or a 1-D integer tensor); convert them yourself where a value is not an int")
    return [int(i) for i in ids]


def as_int_array(ids: Any, name: str = "ids", what: str = "token ids") -> np.ndarray:
    """`as_int_list`'s checks, the ids as an int64 array: no Python step per id for a tensor, an
    array or a list of plain ints. OverflowError: an int past int64 (no token id is)."""
    if hasattr(ids, "numpy") and hasattr(ids, "dtype") and getattr(ids, "ndim", 0) == 1 \
            and "int" in str(ids.dtype) and not getattr(ids, "is_cuda", False):
        return np.asarray(ids.detach().numpy() if hasattr(ids, "detach") else ids, dtype=np.int64)
    if isinstance(ids, np.ndarray) and ids.ndim == 1 and (ids.dtype.kind == "i" or
                                                          (ids.dtype.kind == "u" and ids.dtype.itemsize < 8)):
        return ids.astype(np.int64, copy=False)
    if isinstance(ids, (list, tuple)) and set(map(type, ids)) <= {int}:
        return np.fromiter(ids, dtype=np.int64, count=len(ids))
    return np.array(as_int_list(ids, name, what), dtype=np.int64).reshape(-1)


def as_index_list(indices: Any, name: str) -> list[int]:
    """Student token indices (a list, tuple, set or 1-D integer tensor) as a list of ints."""
    if isinstance(indices, Set):
        indices = list(indices)
    return as_int_list(indices, name, "student token indices")
