"""The ``gemm`` backend: the fused head's logits made by the vendor's GEMM (cuBLAS through
``torch.mm``; the CPU BLAS under Triton's interpreter), then the Triton kernels' row pass over them.

Forward, per row chunk: ``z = h[chunk] @ W[:V_local]ᵀ`` into one fp32 [chunk, V_local] buffer
(fp32 output from bf16/fp16 operands, fp32 accumulation: every logit, the target's included, is
the fp32 GEMM result, never read back from a bf16 copy), then one launch of the row kernel
(:mod:`._fold`: online max, Σe, Σe·u, the marked ids' logits, the subset's sums) over the buffer;
the top-k ids likewise (:mod:`._topk` over the buffer). Backward, per vocabulary slice: the slice
``z[:, c0:c1]`` recomputed by the GEMM into fp32, one launch of the gradient kernel (:mod:`._grad`)
writing dz in the inputs' dtype, then dW[c0:c1] = dzᵀ·h written once and dh += dz·W[c0:c1]
(fp32), as the triton backend's backward. So the matmul work is the vendor's (three GEMMs of
T·H·V_local with the recompute, four with the forward), and the Triton work is the streaming row
passes over fp32 buffers.

Memory: the forward buffer is at most FORWARD_SHARE of U = T·V_local·4 bytes (and
FORWARD_CAP_BYTES), so at least MIN_CHUNK_ROWS rows where that allows; the backward's z and dz
slices together at most BACKWARD_SHARE of U (and BACKWARD_CAP_BYTES). With dh's fp32 accumulator
(H/V_local of U) the excess stays under 0.1 U at H/V_local ≤ 0.03 (H = 4,096, V_local ≥ 131,072).

Logits sources and fp64 go to the triton backend (logits are already the buffer) / the torch tiles.
Tensor parallelism: each rank runs this on its shard; the cross-rank combine is the contract's.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import torch

from megatron_rl_patches._log import warn_once
from megatron_rl_patches.ops._stats import GradFactors, RowStats
from megatron_rl_patches.ops._vocab import row_chunks
from megatron_rl_patches.ops.kernels.contract import Backend
from megatron_rl_patches.ops.kernels.sources import Source
from megatron_rl_patches.ops.kernels.torch_tiles import CPU_TILE_BYTES
from megatron_rl_patches.ops.kernels.triton.backend import TritonTiles, column_block_grads
from megatron_rl_patches.ops.kernels.triton.launch import blocks
from megatron_rl_patches.ops.topk_select import RunningTopk

FORWARD_SHARE = 1 / 16
FORWARD_CAP_BYTES = 1 << 30
BACKWARD_SHARE = 1 / 24
BACKWARD_CAP_BYTES = 1 << 30
MIN_CHUNK_ROWS = 1024


def forward_chunk_rows(n_rows: int, n_valid: int, device: torch.device, chunk_rows: int | None) -> int:
    """Rows of one forward GEMM: the op's chunk_size when given, else as many as the buffer's
    budget allows (MIN_CHUNK_ROWS where it does), at least one row block of the row kernel."""
    if chunk_rows:
        return chunk_rows
    row_bytes = n_valid * 4
    cap = FORWARD_CAP_BYTES if device.type == "cuda" else CPU_TILE_BYTES
    budget = min(cap, int(FORWARD_SHARE * n_rows * row_bytes))
    return max(blocks(device, False).m, min(n_rows, budget // row_bytes))


def backward_slice_width(n_rows: int, n_valid: int, dz_bytes: int, device: torch.device) -> int:
    """Columns of one backward vocabulary slice: its fp32 z and its dz within the budget, at
    least one column tile of the gradient kernel."""
    cap = BACKWARD_CAP_BYTES if device.type == "cuda" else CPU_TILE_BYTES
    budget = min(cap, int(BACKWARD_SHARE * n_rows * n_valid * 4))
    return min(n_valid, max(blocks(device, False).n, budget // (n_rows * (4 + dz_bytes))))


class Fp32Products:
    """``a @ bᵀ`` in fp32 into a given buffer: fp32 output from half operands where the vendor's
    GEMM has it (``torch.mm(..., out_dtype=float32)`` on CUDA), else the operands upcast (CPU)."""

    def __init__(self) -> None:
        self.out_dtype_works = True

    def __call__(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if a.dtype == torch.float32:
            return torch.mm(a, b.t(), out=out)
        if a.device.type == "cuda" and self.out_dtype_works:
            try:
                return torch.mm(a, b.t(), out_dtype=torch.float32, out=out)
            except (RuntimeError, TypeError) as error:  # a torch without it: upcast, as on CPU
                self.out_dtype_works = False
                warn_once(f"backend 'gemm': this torch's torch.mm has no fp32 output from {a.dtype} operands "
                          f"({type(error).__name__}: {error}); each chunk's operands are upcast to fp32 instead "
                          "(the same values, several times slower): use the 'triton' backend here")
        return torch.mm(a.float(), b.float().t(), out=out)


class VendorGemm(Backend):
    """The ``gemm`` backend (see the module docstring)."""

    name = "gemm"

    def __init__(self) -> None:
        self.kernels = TritonTiles()
        self.products = Fp32Products()

    def available(self, device: torch.device) -> str | None:
        return self.kernels.available(device)

    def claims(self, device: torch.device) -> bool:
        return self.kernels.claims(device)

    def invariant_backend(self) -> Backend:
        return self.kernels.invariant_backend()

    def _passes_through(self, source: Source) -> bool:
        return not source.fused or source.first.dtype == torch.float64

    def row_stats(self, source: Source, stats: RowStats, cols: torch.Tensor, owned: torch.Tensor,
                  keep_mask: torch.Tensor | None, scale: float | torch.Tensor) -> RowStats:
        if self._passes_through(source) or stats.shift.dtype == torch.float64:
            return self.kernels.row_stats(source, stats, cols, owned, keep_mask, scale)
        n_valid = source.n_valid
        for r0, r1, z in self._row_chunk_logits(source):
            self.kernels.row_stats(Source(n_valid, None, logits=z), _rows_of(stats, r0, r1), cols[r0:r1],
                                   owned[r0:r1], None if keep_mask is None else keep_mask[r0:r1],
                                   _scale_rows(scale, r0, r1))
        return stats

    def topk(self, source: Source, run: RunningTopk, first_id: int) -> RunningTopk:
        if self._passes_through(source):
            return self.kernels.topk(source, run, first_id)
        values, ids, row_max = run.values.clone(), run.ids.clone(), run.row_max.clone()
        n_valid = source.n_valid
        for r0, r1, z in self._row_chunk_logits(source):
            part = RunningTopk(values[r0:r1], ids[r0:r1], run.ambiguous[r0:r1], row_max[r0:r1], run.sentinel)
            got = self.kernels.topk(Source(n_valid, None, logits=z), part, first_id)
            values[r0:r1], ids[r0:r1], row_max[r0:r1] = got.values, got.ids, got.row_max
        return RunningTopk(values, ids, run.ambiguous, row_max, run.sentinel)

    def _row_chunk_logits(self, source: Source) -> Iterator[tuple[int, int, torch.Tensor]]:
        """(r0, r1, z) per forward row chunk: z [r1 − r0, V_local] fp32, one buffer reused."""
        hidden, weight = _fused(source)
        n_rows, n_valid = source.n_rows, source.n_valid
        if n_rows == 0 or n_valid == 0:
            return
        rows = forward_chunk_rows(n_rows, n_valid, hidden.device, source.chunk_rows)
        buf = torch.empty(min(rows, n_rows), n_valid, dtype=torch.float32, device=hidden.device)
        for r0, r1 in row_chunks(n_rows, rows):
            yield r0, r1, self.products(hidden[r0:r1], weight[:n_valid], buf[: r1 - r0])

    def apply_grad(self, source: Source, factors: GradFactors, scale: float | torch.Tensor,
                   keep_mask: torch.Tensor | None, needs: tuple[bool, ...]) -> tuple[torch.Tensor | None, ...]:
        if self._passes_through(source) or factors.dtype == torch.float64:
            return self.kernels.apply_grad(source, factors, scale, keep_mask, needs)
        if factors.mark_alpha is not None and factors.alpha is None:
            raise ValueError("GradFactors with mark_alpha but no alpha: the marked e^(u - L) term needs the full shift")
        hidden, weight = _fused(source)
        n_rows, n_valid = source.n_rows, source.n_valid
        half = hidden.dtype in (torch.bfloat16, torch.float16)
        dz_bytes = hidden.dtype.itemsize if half else factors.dtype.itemsize
        width = backward_slice_width(n_rows, n_valid, dz_bytes, hidden.device)
        if source.chunk_rows:  # the op's chunk_size caps a slice at chunk_size·V_local entries, as elsewhere
            width = min(width, max(1, source.chunk_rows * n_valid // max(1, n_rows)))
        z_buf = torch.empty(n_rows, min(width, n_valid), dtype=torch.float32, device=hidden.device)

        def write_dz(dz: torch.Tensor, c0: int, c1: int) -> None:
            z = self.products(hidden, weight[c0:c1], z_buf[:, : c1 - c0])
            inside = factors.owned & (factors.cols >= c0) & (factors.cols < c1)
            local = dataclasses.replace(factors, cols=factors.cols - c0, owned=inside)
            self.kernels.grad_tiles(Source(c1 - c0, None, logits=z), local, scale,
                                    None if keep_mask is None else keep_mask[:, c0:c1], dz, 0, n_rows, 0, c1 - c0)

        return column_block_grads(source, factors.dtype, needs, write_dz, block_width=width)


def _fused(source: Source) -> tuple[torch.Tensor, torch.Tensor]:
    assert source.hidden is not None and source.weight is not None  # a fused source
    return source.hidden, source.weight


def _rows_of(stats: RowStats, r0: int, r1: int) -> RowStats:
    """Views of the statistics' rows [r0, r1): the row pass writes them in place."""
    def rows(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[r0:r1]

    return RowStats(shift=stats.shift[r0:r1], marked=stats.marked[r0:r1], rest=rows(stats.rest),
                    moment=rows(stats.moment), sub_shift=rows(stats.sub_shift), sub_sum=rows(stats.sub_sum))


def _scale_rows(scale: float | torch.Tensor, r0: int, r1: int) -> float | torch.Tensor:
    if isinstance(scale, torch.Tensor) and scale.dim() > 0 and scale.size(0) > 1:
        return scale[r0:r1]
    return scale
