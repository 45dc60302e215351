"""The padding of a micro-batch in its shared-prefix plan: computed as megatron-core's packed path
computes it.

The rows after the samples are padding: each sequence of `cu_seqlens` past the samples, then the
rows past `cu_seqlens[-1]` as one more sequence. megatron-core's packed path computes each padding
row by its own id, at its position in its sequence, seeing that sequence's earlier rows, and its MoE
statistics (the aux losses, the z-loss, the expert-bias counts, Sinkhorn's balancing over the batch)
and the MTP loss count every one. So the plan lays each padding sequence out as packed: a segment of
its own after the samples' (shared with nothing), each row on a physical row of its own.

One exception, asked for by a caller that knows its model (`repeated_once`): a padding sequence of
one repeated id (slime pads with id 0, up to 128 x TP rows) is one physical row that each of its rows
reads. That is exact only where the model computes every row of such a run alike (`repeated_padding`
says which models do: softmax attention without a sink at rotary or no positions, no recurrent
layer); elsewhere the rows differ and every statistic reading them with them. After the padding
come the rows that pad the stream to a multiple of `pad_to` (`filler`), read by nothing."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PaddingLayout:
    """The padding's segments after the samples' rows (int64 tensors [n]): each one's first logical row
    (`sources`, -1 for the filler) and its `lengths`; `logical_rows` [`tokens`]: each padding row's
    physical row, counted from the padding's first; `tokens` the padding's rows as packed, `filler`
    the rows padding the stream to the multiple, of id `filler_id`."""

    sources: torch.Tensor
    lengths: torch.Tensor
    logical_rows: torch.Tensor
    tokens: int
    filler: int
    filler_id: torch.Tensor

    @property
    def rows(self) -> int:
        """The physical rows after the samples': the padding's and the filler's."""
        return int(self.lengths.sum())


def padding_sequences(bounds: list[int], samples: int, length: int) -> list[tuple[int, int]]:
    """(start, end) of each padding sequence of a stream of `length` packed ids with boundaries
    `bounds`: each non-empty sequence past the first `samples`, then the rows past `bounds[-1]` as one
    more (megatron-core's packed path runs no row past `cu_seqlens[-1]`: its `thd` RoPE splits the rows
    by `cu_seqlens`; the plan runs them as one sequence)."""
    runs = [(start, end) for start, end in zip(bounds[samples:], bounds[samples + 1:]) if end > start]
    return runs + ([(bounds[-1], length)] if length > bounds[-1] else [])


def padding_layout(ids: torch.Tensor, bounds: list[int], samples: int, sample_rows: int, pad_to: int,
                   repeated_once: bool = False) -> PaddingLayout:
    """The padding of the packed `ids` (boundaries `bounds`, the first `samples` sequences samples)
    after the samples' `sample_rows` physical rows, the whole stream padded to a multiple of `pad_to`;
    `repeated_once`: a padding sequence of one repeated id computed on one row (see the module)."""
    sources, lengths, rows = [], [], []
    placed = 0
    for start, end in padding_sequences(bounds, samples, ids.numel()):
        once = repeated_once and bool((ids[start:end] == ids[start]).all())
        sources.append(start)
        lengths.append(1 if once else end - start)
        rows.append(torch.full((end - start,), placed) if once else placed + torch.arange(end - start))
        placed += lengths[-1]
    tokens = ids.numel() - bounds[samples]
    filler = (-(sample_rows + placed)) % pad_to
    if filler:
        sources.append(-1)
        lengths.append(filler)
    return PaddingLayout(sources=torch.tensor(sources, dtype=torch.int64),
                         lengths=torch.tensor(lengths, dtype=torch.int64),
                         logical_rows=torch.cat(rows) if rows else torch.empty(0, dtype=torch.int64), tokens=tokens,
                         filler=filler, filler_id=ids[bounds[samples]] if tokens else torch.tensor(0))
