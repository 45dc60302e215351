"""The tile GEMM under Triton's interpreter, for the row-invariance checks of the Triton kernel on CPU.

Under TRITON_INTERPRET=1 each ``tl.dot`` is ``numpy.matmul`` of the tile, i.e. the sgemm of
numpy's own OpenBLAS, whose kernel follows the CPU or OPENBLAS_CORETYPE. Some of those kernels
give a row other bits by its position in the tile (OpenBLAS 0.3.34's Haswell sgemm: rows 6-11
of every 12, whatever the other rows hold). That is the interpreter's arithmetic, not the
kernel's: on a GPU the tile's MMA treats every row alike. So the checks split what the kernel's
code controls from what the interpreter's BLAS does:

- :func:`dot_keeps_rows`: a probe of the dot at the kernel's tile shape (one row at every
  position among random rows): where it holds, the interpreter's own dot is checked bit for bit;
- :func:`row_by_row_dot`: a stand-in for the interpreter's dot that multiplies each row of the
  tile alone, in one call shape (so row-invariant by construction): the kernel's structure
  (fixed tile shapes, fixed chunking of the hidden size, fixed combine order) is checked bit
  for bit with it on any CPU.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

Dot = Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]


def interpreter_dot(a: np.ndarray, b: np.ndarray, acc: np.ndarray) -> np.ndarray:
    """``acc + a @ b`` exactly as the interpreter's tl.dot computes it (fp32 operands)."""
    import triton.language as tl
    from triton.runtime.interpreter import TensorHandle, interpreter_builder

    out = interpreter_builder.create_dot(TensorHandle(a, tl.float32), TensorHandle(b, tl.float32),
                                         TensorHandle(acc, tl.float32), "ieee", 0)
    return out.data


def dot_keeps_rows(m: int, n: int, k: int, dot: Dot = interpreter_dot, trials: int = 4) -> bool:
    """Whether `dot` on [m, k] @ [k, n] (+ [m, n]) fp32 tiles gives a row the same bits at every
    position of the tile, whatever the other rows."""
    rng = np.random.default_rng(0)
    for _ in range(trials):
        row, acc_row = rng.standard_normal(k, dtype=np.float32), rng.standard_normal(n, dtype=np.float32)
        b = rng.standard_normal((k, n), dtype=np.float32)
        first = None
        for position in range(m):
            a, acc = rng.standard_normal((m, k), dtype=np.float32), rng.standard_normal((m, n), dtype=np.float32)
            a[position], acc[position] = row, acc_row
            got = dot(a, b, acc)[position]
            if first is None:
                first = got
            elif not np.array_equal(got, first):
                return False
    return True


def rows_alone(a: np.ndarray, b: np.ndarray, acc: np.ndarray) -> np.ndarray:
    """``acc + a @ b`` with each row of `a` multiplied alone ([1, k] @ [k, n]: the same call for
    every row, so a row's bits cannot follow its position or its neighbours)."""
    return np.concatenate([np.matmul(a[i:i + 1], b, dtype=acc.dtype) for i in range(a.shape[0])]) + acc


def row_by_row_dot(self: Any, a: Any, b: Any, d: Any, input_precision: Any, max_num_imprecise_acc: Any) -> Any:
    """:func:`rows_alone` as the interpreter's ``InterpreterBuilder.create_dot``."""
    from triton.runtime.interpreter import TensorHandle

    return TensorHandle(rows_alone(a.data, b.data, d.data), d.dtype.scalar)
