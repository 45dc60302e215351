"""Buffers that torch's CPU elementwise loops walk in whole vector steps only.

A CPU elementwise op runs a vector loop two vectors at a time and hands the remainder of each
thread's part to a scalar loop; for ``exp2`` the two loops round differently (about 6 % of fp32
elements), so an element's bits would depend on where it sits. ``exp`` goes through one vector
path for remainders too, but costs about three times ``exp2``. A contiguous buffer whose every
thread's part is a multiple of the vector step has no remainder: each element takes the vector
path, wherever it sits and whatever the thread count (each thread's part then starts and ends on
a step). The padding columns and rows are computed and never read.
"""
from __future__ import annotations

import torch

# Elements: a multiple of every CPU vector loop's step (two vectors of up to 512 bits: 32 fp32, 16 fp64).
VECTOR_STEP = 64
# torch's grain for an elementwise op (at::internal::GRAIN_SIZE): n elements run on one thread up to
# it, else in min(threads, ceil(n / GRAIN)) parts of ceil(n / parts) elements, one per thread.
PARALLEL_GRAIN = 32768


def padded_width(cols: int) -> int:
    """Columns of a buffer holding `cols` real ones: the next multiple of VECTOR_STEP."""
    return max(VECTOR_STEP, -(-cols // VECTOR_STEP) * VECTOR_STEP)


def padded_rows(rows: int, width: int, threads: int | None = None) -> int:
    """The fewest rows ≥ `rows` whose [rows, width] buffer (width from :func:`padded_width`) torch
    splits over its `threads` (None: torch's count) in parts of whole vector steps."""
    threads = torch.get_num_threads() if threads is None else threads
    steps = width // VECTOR_STEP
    n = max(rows, 1)
    while True:
        used = max(1, min(threads, -(-(n * width) // PARALLEL_GRAIN)))
        if (n * steps) % used == 0:
            return n
        n += 1
