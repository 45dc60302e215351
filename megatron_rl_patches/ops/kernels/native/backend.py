"""The invariant mode on CPU with its rest and moment sums from the compiled kernel
(:mod:`.source`): the torch invariant tiles (the same maxima, passes and fixed-point integers) with
one pass per row in place of the exponent, the conversions and the sums. Each row's bits depend
on that row alone, as the torch tiles'; the exponent is the kernel's polynomial, so its values are
within ~1e-7 (relative) of the torch tiles', not their bits: every rank of a group must run it
(the route is agreed over the group, :func:`..invariance.agreed_route`)."""
from __future__ import annotations

import ctypes

import torch
import torch.distributed as dist

from megatron_rl_patches.ops._stats import NEG_FLOOR, RowStats
from megatron_rl_patches.ops.kernels.contract import Backend
from megatron_rl_patches.ops.kernels.invariant_tiles import InvariantTiles, invariant_row_stats
from megatron_rl_patches.ops.kernels.sources import Source
from megatron_rl_patches.settings import NATIVE

_KINDS = {torch.float32: 0, torch.bfloat16: 1}


class InvariantNative(InvariantTiles):
    """The invariant tiles whose rest and moment sums of fp32 / bf16 logits (fp32 statistics) come
    from the compiled kernel `library`; the gradients of `base`."""

    name = f"invariant with compiled CPU sums ({NATIVE}=0: the torch tiles)"

    def __init__(self, base: Backend, library: ctypes.CDLL) -> None:
        super().__init__(base)
        self.library = library

    def row_stats(self, source: Source, stats: RowStats, cols: torch.Tensor, owned: torch.Tensor,
                  keep_mask: torch.Tensor | None, scale: float | torch.Tensor) -> RowStats:
        return invariant_row_stats(source, stats, cols, owned, keep_mask, scale, None, self.rest_sums)

    def combined_stats(self, source: Source, stats: RowStats, cols: torch.Tensor, owned: torch.Tensor,
                       keep_mask: torch.Tensor | None, scale: float | torch.Tensor,
                       group: dist.ProcessGroup | None) -> RowStats:
        return invariant_row_stats(source, stats, cols, owned, keep_mask, scale, group, self.rest_sums)

    def rest_sums(self, x: torch.Tensor, shift: torch.Tensor, scale2: torch.Tensor, local: torch.Tensor,
                  inside: torch.Tensor, rest: torch.Tensor, moment: torch.Tensor | None) -> bool:
        """:data:`..invariant_tiles.RestSums` by the kernel: fp32 or bf16 rows on CPU, fp32
        statistics; False otherwise. Rows of another column stride (column-major or strided
        logits) are copied to unit stride first, so every layout of the same values takes the
        kernel and gets its bits (before, they took the torch tiles' exponent: other bits)."""
        kind = _KINDS.get(x.dtype)
        if kind is None or x.device.type != "cpu" or shift.dtype != torch.float32:
            return False
        rows = x.size(0)
        if rows == 0 or x.size(1) == 0:
            return True
        if x.size(1) > 1 and x.stride(1) != 1:
            x = x.contiguous()  # the kernel walks rows of unit column stride (one row chunk, ≤ 4 MiB)
        shift = shift.contiguous()
        scale2 = scale2.to(torch.float32).expand(rows).contiguous()
        local = local.to(torch.int64).contiguous()
        inside = inside.to(torch.uint8).contiguous()
        for out in (rest, moment):
            assert out is None or (out.dtype == torch.int64 and out.is_contiguous())  # ints' row slices
        self.library.invariant_row_sums(
            x.data_ptr(), kind, x.stride(0), rows, x.size(1), shift.data_ptr(), scale2.data_ptr(), NEG_FLOOR,
            local.data_ptr(), inside.data_ptr(), local.size(1), rest.data_ptr(),
            None if moment is None else moment.data_ptr(), torch.get_num_threads())
        return True
