"""Sources of logits tiles: materialized logits, or hidden states times an output-weight shard.

A source is what a backend walks; the tensor-parallel plumbing around it (gathering hidden rows
under sequence parallelism, summing dL/dh over the ranks) is done here, outside the backends.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_rl_patches.ops import _dist


@dataclass(frozen=True)
class Source:
    """Logits [T, V_local] (`logits`), or ``hidden [T, H] @ weight[V_local, H].T`` (every row of
    hidden, gathered); only the first `n_valid` columns are real vocabulary ids. `chunk_rows`:
    rows per tile (None: the backend's budget); `inplace`: the logits' gradient may be written
    into their own storage; `shape_rows`: the row count tiles are shaped for (a row selection
    tiles its rows as all rows are, so each row's values keep their bits)."""

    n_valid: int
    chunk_rows: int | None
    logits: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    weight: torch.Tensor | None = None
    inplace: bool = False
    shape_rows: int | None = None  # rows the tile shape is chosen for (None: n_rows); a row selection keeps all's

    @property
    def fused(self) -> bool:
        return self.logits is None

    @property
    def first(self) -> torch.Tensor:
        first = self.hidden if self.fused else self.logits
        assert first is not None  # logits, or the fused head's hidden
        return first

    @property
    def n_rows(self) -> int:
        return self.first.size(0)


def gather_rows(hidden: torch.Tensor, group: dist.ProcessGroup | None, sequence_parallel: bool) -> torch.Tensor:
    """Under sequence parallelism every rank's [T/tp, H] slice, concatenated in rank order."""
    if not sequence_parallel or _dist.tp_size(group) == 1:
        return hidden
    parts = [torch.empty_like(hidden) for _ in range(_dist.tp_size(group))]
    # all-gather over the tensor-parallel group of each rank's sequence-parallel rows: every
    # rank's vocab shard needs the logits of all T rows
    dist.all_gather(parts, hidden.contiguous(), group=group)
    return torch.cat(parts)


def reduce_rows(grad_hidden: torch.Tensor, group: dist.ProcessGroup | None, sequence_parallel: bool) -> torch.Tensor:
    """dL/dh summed over the tensor-parallel ranks (each rank's vocab shard contributes); under
    sequence parallelism only this rank's rows are kept (a reduce-scatter)."""
    size = _dist.tp_size(group)
    if size == 1:
        return grad_hidden
    if sequence_parallel and dist.get_backend(group) != "gloo":  # gloo has no reduce-scatter
        out = grad_hidden.new_empty(grad_hidden.size(0) // size, grad_hidden.size(1))
        # reduce-scatter (SUM) over the tensor-parallel group: each rank's vocab shard adds its
        # part of dL/dh for every row; each rank keeps the sum over its own sequence-parallel rows
        dist.reduce_scatter_tensor(out, grad_hidden.contiguous(), group=group)
        return out
    # SUM all-reduce over the tensor-parallel group: dL/dh is the sum of every vocab shard's part
    dist.all_reduce(grad_hidden, group=group)
    if not sequence_parallel:
        return grad_hidden
    rows = grad_hidden.size(0) // size
    rank = _dist.tp_rank(group)
    return grad_hidden[rank * rows : (rank + 1) * rows]
