"""NeMo-RL's row layouts, for values computed at the rows a rank's model sees.

A NeMo-RL micro-batch (`ProcessedMicrobatch`) is either unpacked ([B, S], no context parallelism)
or packed: its sequences laid end to end ([1, T], padded per sequence to `cu_seqlens_padded`),
each cut into 2·cp chunks of which context-parallel rank r holds chunks r and 2·cp−1−r (zigzag).
`local_*` put per-token values at a rank's rows (the model's `labels=` and top-k ids);
`whole_rows` gathers them back over the context-parallel group with NeMo-RL's own
`allgather_cp_sharded_tensor` (its gradient rule too) and `unpacked` lays them out as NeMo-RL's
post-processors return them ([B, S', ...])."""
# lazy imports: optional dependency nemo_rl (and megatron-core)
from __future__ import annotations

from typing import Any

import torch

from megatron_rl_patches.ops.context_rows import sequence_rows


class Layout:
    """Where a micro-batch's tokens are on this rank: packed or not, the CP group, the sequences."""

    def __init__(self, microbatch: Any, packed: bool) -> None:
        from megatron.core import parallel_state  # lazy: optional dependency megatron-core

        self.microbatch = microbatch
        self.packed = packed
        self.cp_size = parallel_state.get_context_parallel_world_size()
        self.cp_rank = parallel_state.get_context_parallel_rank()
        self.cp_group = parallel_state.get_context_parallel_group() if self.cp_size > 1 else None
        self.batch, self.seq_len = microbatch.data_dict["input_ids"].shape[:2]
        cu = microbatch.cu_seqlens_padded
        self.bounds = None if cu is None else [int(v) for v in cu.tolist()]
        if packed and self.bounds is None:
            raise ValueError("a packed NeMo-RL micro-batch needs cu_seqlens_padded")

    def sequences(self) -> list[tuple[int, int]]:
        assert self.bounds is not None
        return list(zip(self.bounds[:-1], self.bounds[1:]))

    def local_sequence(self, values: torch.Tensor) -> torch.Tensor:
        """One whole sequence's rows [L, ...] -> this rank's rows of it [L/cp, ...] (zigzag)."""
        if self.cp_size == 1:
            return values
        rows = sequence_rows("zigzag", self.cp_rank, self.cp_size, values.shape[0]).to(values.device)
        return values.index_select(0, rows)

    def local_targets(self) -> torch.Tensor:
        """The next-token id at each row this rank's model sees: [B, S] unpacked, [1, T/cp] packed
        (each sequence's ids rolled by one, as NeMo-RL's log-prob functions roll them)."""
        ids = self.microbatch.input_ids
        if not self.packed:
            return ids.roll(shifts=-1, dims=-1)
        flat = ids.reshape(-1)
        pieces = [self.local_sequence(flat[start:end].roll(shifts=-1, dims=0)) for start, end in self.sequences()]
        return torch.cat(pieces).unsqueeze(0)

    def local_values(self, values: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
        """Per-token values [B, S, ...] (unpacked) at this rank's rows: [B, S, ...] unpacked,
        [1, T/cp, ...] packed (a sequence's padding rows hold `fill`)."""
        if not self.packed:
            return values
        lengths = self.microbatch.data_dict["input_lengths"]
        pieces = []
        for index, (start, end) in enumerate(self.sequences()):
            whole = fill.expand(end - start, *values.shape[2:]).clone()
            length = min(int(lengths[index]), end - start)
            whole[:length] = values[index, :length]
            pieces.append(self.local_sequence(whole))
        return torch.cat(pieces).unsqueeze(0)

    def whole_rows(self, local: torch.Tensor) -> torch.Tensor:
        """Packed values at this rank's rows [1, T/cp, ...] -> every sequence's whole rows [T, ...]."""
        flat = local[0]
        if self.cp_size == 1:
            return flat
        from nemo_rl.distributed.model_utils import allgather_cp_sharded_tensor  # lazy: optional dependency nemo_rl

        return torch.cat([allgather_cp_sharded_tensor(flat[start // self.cp_size:end // self.cp_size],
                                                      self.cp_group, seq_dim=0)
                          for start, end in self.sequences()])

    def unpacked(self, local: torch.Tensor, length: int, *, lengths: Any = None) -> torch.Tensor:
        """Values at this rank's rows -> [B, length, ...] (NeMo-RL's unpacked layout, zeros past a
        sequence). Unpacked input is cut to `length`; packed sequence i gives its first
        min(its padded length − 1, length) rows, or (with `lengths`) its first lengths[i] rows."""
        if not self.packed:
            return local[:, :length]
        whole = self.whole_rows(local)
        out = whole.new_zeros(self.batch, length, *whole.shape[1:])
        for index, (start, end) in enumerate(self.sequences()):
            count = (end - start - 1) if lengths is None else int(lengths[index])
            count = min(count, length)
            if count > 0:
                out[index, :count] = whole[start:start + count]
        return out
