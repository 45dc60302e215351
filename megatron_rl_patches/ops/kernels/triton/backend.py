"""The Triton backend: the row statistics (forward) and the gradients (backward) of the backend
contract (:mod:`megatron_rl_patches.ops._stats`) as Triton kernels, CUDA tensors (or CPU tensors
under Triton's interpreter, for tests).

Forward (:mod:`._fold`): one kernel per call, grid (row blocks × vocabulary splits); each program
folds its tiles online (for a hidden-state source x = h·Wᵀ is recomputed in registers with
``tl.dot``, never stored) and the splits are merged here with the cross-rank combine's rescaling.

Backward (:mod:`._grad`): one kernel writes dL/dx of every tile once. For materialized logits
that is the logits' gradient (in their own storage with ``inplace``). For a hidden-state source
it is dz of a block of columns ([T, width] in the inputs' dtype, `width` from a byte budget), and
two cuBLAS matmuls give dW[block] = dzᵀ·h (each row of dW made once, written in the weight's
dtype) and dh += dz·W[block] (fp32 accumulator, T·H·4 B): deterministic (fixed blocks, fixed
order), the recompute being the one extra T·H·V matmul of the fused head (4/3 of the unfused
flops). Excess memory: the dz block (256 MiB on CUDA) + dh's fp32 accumulator and one [T, H]
matmul result, about 0.03-0.06 U at V = 151936. A single-pass Triton dh/dW would need atomics
(not deterministic) or a [rows, H] read-modify-write per vocabulary tile.

fp64 inputs go to the torch tiles (tl.dot has no fp64 path on every GPU; fp64 is a reference
dtype here, not a training one).
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
import triton

from megatron_rl_patches.ops._divergences import ResolvedDivergence
from megatron_rl_patches.ops._stats import GradFactors, RowStats, finite_or_zero, moved_stats, per_row
from megatron_rl_patches.ops._vocab import row_chunks
from megatron_rl_patches.ops.kernels.contract import Backend
from megatron_rl_patches.ops.kernels.sources import Source
from megatron_rl_patches.ops.kernels.torch_tiles import (
    CPU_TILE_BYTES,
    CUDA_TILE_BYTES,
    TorchTiles,
    logits_grad_buffer,
)
from megatron_rl_patches.ops.kernels.triton._divergence import KERNEL_DIVERGENCES, divergence_tile_kernel
from megatron_rl_patches.ops.kernels.triton._fold import row_stats_kernel
from megatron_rl_patches.ops.kernels.triton._grad import grad_tile_kernel
from megatron_rl_patches.ops.kernels.triton._topk import topk_tile_kernel
from megatron_rl_patches.ops.kernels.triton.invariant_backend import InvariantTriton
from megatron_rl_patches.ops.kernels.triton.launch import (
    INTERPRETED,
    Blocks,
    blocks,
    column_splits,
    or_dummy,
    src_args,
    tile_args,
)
from megatron_rl_patches.ops.kernels.triton.topk_launches import topk_launch_shape
from megatron_rl_patches.ops.topk_select import RunningTopk, best_of


class TritonTiles(Backend):
    """The ``triton`` backend (see the module docstring)."""

    name = "triton"

    def __init__(self) -> None:
        self._torch = TorchTiles()

    def available(self, device: torch.device) -> str | None:
        if device.type == "cuda":
            if torch.version.hip:
                return f"ROCm (torch.version.hip={torch.version.hip}) is not supported by these kernels"
            return None
        if device.type == "cpu":
            if INTERPRETED:
                return None
            return ("CPU tensors run Triton kernels only under its interpreter: set TRITON_INTERPRET=1 before "
                    "megatron_rl_patches.ops.kernels.triton is first imported")
        return f"Triton kernels run on CUDA tensors, not on {device.type}"

    def claims(self, device: torch.device) -> bool:
        return device.type == "cuda" and not torch.version.hip

    def invariant_backend(self) -> Backend:
        """The invariant mode's forward as a Triton kernel (:mod:`.invariant_backend`), these gradients."""
        return InvariantTriton(self)

    # ------------------------------------------------------------------------- forward

    def row_stats(self, source: Source, stats: RowStats, cols: torch.Tensor, owned: torch.Tensor,
                  keep_mask: torch.Tensor | None, scale: float | torch.Tensor) -> RowStats:
        """Overwrites `stats` (which must be empty, as the contract hands it) with the shard's statistics."""
        dtype = stats.shift.dtype
        if dtype == torch.float64 or source.first.dtype == torch.float64:
            return self._torch.row_stats(source, stats, cols, owned, keep_mask, scale)
        n_rows, n_valid, k = source.n_rows, source.n_valid, cols.size(1)
        if n_rows == 0 or n_valid == 0:
            return stats
        device = source.first.device
        b = blocks(device, source.fused)
        splits, cols_per_split = column_splits(n_rows, n_valid, b, device)
        parts = RowStats.empty(splits * n_rows, k, dtype, device, rest=stats.rest is not None,
                               moment=stats.moment is not None, subset=stats.sub_shift is not None)
        dummy = parts.shift
        src, weight, n_hidden, *strides = src_args(source)
        a = tile_args(keep_mask, scale, dtype, (cols, owned) if k else None)
        grid = (triton.cdiv(n_rows, b.m), splits)
        row_stats_kernel[grid](
            src, weight, *a.pointers(dummy),
            parts.shift, or_dummy(parts.rest, dummy), or_dummy(parts.moment, dummy), or_dummy(parts.sub_shift, dummy),
            or_dummy(parts.sub_sum, dummy), parts.marked,
            n_rows, n_valid, n_hidden, cols_per_split, a.scale_value, *strides, *a.keep_strides,
            K=k, FUSED=source.fused, ROW_SCALE=a.scale is not None, HAS_REST=parts.rest is not None,
            HAS_MOMENT=parts.moment is not None, HAS_SUB=parts.sub_shift is not None, HAS_KEEP=a.keep is not None,
            **b.launch(source.first.dtype),
        )
        merged = merge_splits(parts, splits, scale)
        for name in ("shift", "marked", "rest", "moment", "sub_shift", "sub_sum"):
            if getattr(stats, name) is not None:
                getattr(stats, name).copy_(getattr(merged, name))
        return stats

    # ------------------------------------------------------------------------- top-k ids

    def topk(self, source: Source, run: RunningTopk, first_id: int) -> RunningTopk:
        """Every tile's k best (value desc, id asc, exact: no ambiguous cut) merged into `run`
        (empty, as the top-k ops hand it); fp64 goes to the torch tiles. The candidates (k per
        vocabulary tile and row) and their merge are made a launch at a time, a block of rows
        times a group of tiles (:func:`.topk_launches.topk_launch_shape`), so the call's excess
        memory stays a small share of T·V_local·4 bytes and does not grow with T."""
        if source.first.dtype == torch.float64:
            return self._torch.topk(source, run, first_id)
        n_rows, n_valid, k = source.n_rows, source.n_valid, run.values.size(1)
        if n_rows == 0 or n_valid == 0:
            return run
        device = source.first.device
        b = blocks(device, source.fused)
        rows_per_launch, cols_per_launch = topk_launch_shape(n_rows, n_valid, k, b.m, b.n, device)
        values, ids, row_max = run.values.clone(), run.ids.clone(), run.row_max.clone()
        for r0, r1 in row_chunks(n_rows, rows_per_launch):
            for c0, c1 in row_chunks(n_valid, cols_per_launch):
                part = _block(source, r0, r1, c0, c1)
                tiles = triton.cdiv(c1 - c0, b.n)
                cand_values = torch.empty(r1 - r0, tiles * k, dtype=torch.float32, device=device)
                cand_ids = torch.empty(r1 - r0, tiles * k, dtype=torch.long, device=device)
                tile_max = torch.empty(tiles, r1 - r0, dtype=torch.float32, device=device)
                src, weight, n_hidden, *strides = src_args(part)
                topk_tile_kernel[(triton.cdiv(r1 - r0, b.m), tiles)](
                    src, weight, cand_values, cand_ids, tile_max, r1 - r0, c1 - c0, n_hidden, first_id + c0,
                    run.sentinel, *strides, K=k, FUSED=part.fused, **b.launch(source.first.dtype),
                )
                best_values, best_ids = best_of(torch.cat([values[r0:r1].float(), cand_values], dim=1),
                                                torch.cat([ids[r0:r1], cand_ids], dim=1), k)
                del cand_values, cand_ids
                values[r0:r1], ids[r0:r1] = best_values.to(values.dtype), best_ids
                row_max[r0:r1] = torch.maximum(row_max[r0:r1], tile_max.amax(dim=0).to(row_max.dtype))
        return RunningTopk(values, ids, run.ambiguous, row_max, run.sentinel)

    # ------------------------------------------------------------------------- backward

    def apply_grad(self, source: Source, factors: GradFactors, scale: float | torch.Tensor,
                   keep_mask: torch.Tensor | None, needs: tuple[bool, ...]) -> tuple[torch.Tensor | None, ...]:
        if factors.dtype == torch.float64 or source.first.dtype == torch.float64:
            return self._torch.apply_grad(source, factors, scale, keep_mask, needs)
        if factors.mark_alpha is not None and factors.alpha is None:
            raise ValueError("GradFactors with mark_alpha but no alpha: the marked e^(u - L) term needs the full shift")
        if not source.fused:
            grad = logits_grad_buffer(source)
            self.grad_tiles(source, factors, scale, keep_mask, grad, 0, source.n_rows, 0, source.n_valid)
            return (grad,)
        return column_block_grads(source, factors.dtype, needs,
                                  lambda dz, c0, c1: self.grad_tiles(source, factors, scale, keep_mask, dz, 0,
                                                                      source.n_rows, c0, c1))

    def grad_tiles(self, source: Source, f: GradFactors, scale: float | torch.Tensor,
                    keep_mask: torch.Tensor | None, out: torch.Tensor, r0: int, r1: int, c0: int, c1: int) -> None:
        """dL/dx of rows [r0, r1) and valid columns [c0, c1) into `out` (its [0, 0] = source [r0, c0])."""
        if r1 <= r0 or c1 <= c0:
            return
        device = source.first.device
        b = blocks(device, source.fused)
        dummy = f.log_sum if f.log_sum is not None else f.log_sub_sum
        assert dummy is not None  # some exp term is always there
        src, weight, n_hidden, *strides = src_args(source)
        k = f.cols.size(1)
        a = tile_args(keep_mask, scale, f.dtype, (f.cols, f.owned) if k else None)
        per_mark = [None if t is None else t.expand(f.cols.shape).contiguous() for t in (f.mark_alpha, f.eta, f.delta)]
        grid = (triton.cdiv(r1 - r0, b.m), triton.cdiv(c1 - c0, b.n))
        grad_tile_kernel[grid](
            src, weight, *a.pointers(dummy), out,
            *(or_dummy(t, dummy) for t in (f.shift, f.log_sum, f.alpha, f.beta, f.sub_shift, f.log_sub_sum, f.gamma)),
            *(or_dummy(t, dummy) for t in per_mark),
            r0, r1, c0, c1, n_hidden, a.scale_value, *strides, *a.keep_strides, out.stride(0), out.stride(1),
            K=k, FUSED=source.fused, ROW_SCALE=a.scale is not None, HAS_ALPHA=f.alpha is not None,
            HAS_BETA=f.beta is not None, HAS_SUB=f.sub_shift is not None, HAS_GAMMA=f.gamma is not None,
            HAS_KEEP=a.keep is not None and f.gamma is not None, HAS_MARK_ALPHA=f.mark_alpha is not None,
            HAS_ETA=f.eta is not None, HAS_DELTA=f.delta is not None,
            **b.launch(source.first.dtype),
        )


    # ------------------------------------------------------------------------- lm_head_divergence

    def serves_divergence(self, student: Source, teachers: list[Source], plan: ResolvedDivergence) -> bool:
        """Whether :meth:`divergence_sums` / :meth:`divergence_grad` take this call: a table row
        the kernels have a branch for (KERNEL_DIVERGENCES), one teacher of the student's dtype,
        not fp64 (the teachers' mixture and fp64 run on the torch tiles)."""
        return (plan.row.name in KERNEL_DIVERGENCES and len(teachers) == 1
                and student.first.dtype != torch.float64 and teachers[0].first.dtype == student.first.dtype)

    def divergence_sums(self, student: Source, teacher: Source, norms: tuple[torch.Tensor, ...],
                        plan: ResolvedDivergence, scale: float | torch.Tensor,
                        keep_mask: torch.Tensor | None) -> torch.Tensor:
        """[T, 2]: this shard's share of the divergence and of G = Σ g per row (pass 2); `norms`:
        each model's [2, T] (shifts, log S) combined over the ranks."""
        n_rows, n_valid, device = student.n_rows, student.n_valid, student.first.device
        if n_rows == 0 or n_valid == 0:
            return torch.zeros(n_rows, 2, dtype=norms[0].dtype, device=device)
        b = blocks(device, True)
        splits, cols_per_split = column_splits(n_rows, n_valid, b, device)
        parts = torch.empty(splits, n_rows, 2, dtype=norms[0].dtype, device=device)
        self._divergence_tiles(student, teacher, norms, plan, scale, keep_mask, None, None, parts, b,
                               (triton.cdiv(n_rows, b.m), splits), 0, n_valid, cols_per_split, grad=False)
        return parts.sum(0)  # the splits in a fixed order

    def divergence_grad(self, student: Source, teacher: Source, norms: tuple[torch.Tensor, ...],
                        plan: ResolvedDivergence, scale: float | torch.Tensor, keep_mask: torch.Tensor | None,
                        constant: torch.Tensor | None, row_factor: torch.Tensor,
                        needs: tuple[bool, ...]) -> tuple[torch.Tensor | None, ...]:
        """(dL/dh, dL/dW) of the student: dz = (g − p·G)·row_factor per tile (G = `constant`, None:
        0), turned into both gradients block of columns by block."""
        b = blocks(student.first.device, True)

        def write_dz(dz: torch.Tensor, c0: int, c1: int) -> None:
            grid = (triton.cdiv(student.n_rows, b.m), triton.cdiv(c1 - c0, b.n))
            self._divergence_tiles(student, teacher, norms, plan, scale, keep_mask, constant, row_factor, dz, b,
                                   grid, c0, c1, b.n, grad=True)

        return column_block_grads(student, norms[0].dtype, needs, write_dz)

    def _divergence_tiles(self, student: Source, teacher: Source, norms: tuple[torch.Tensor, ...],
                          plan: ResolvedDivergence, scale: float | torch.Tensor, keep_mask: torch.Tensor | None,
                          constant: torch.Tensor | None, row_factor: torch.Tensor | None, out: torch.Tensor,
                          b: Blocks, grid: tuple[int, int], c0: int, c1: int, cols_per_split: int, *,
                          grad: bool) -> None:
        dtype = norms[0].dtype
        dummy = norms[0]
        a = tile_args(keep_mask, scale, dtype)
        keep, _, scale_t = a.pointers(dummy)
        w = plan.weight
        inside = 0.0 < w < 1.0  # log w and log(1 − w) are read only by the mixtures, whose w is inside
        h_s, w_s, n_s, *s_strides = src_args(student)
        h_t, w_t, n_t, *t_strides = src_args(teacher)
        divergence_tile_kernel[grid](
            h_s, w_s, h_t, w_t, norms[0].contiguous(), norms[1].contiguous(), keep,
            scale_t, or_dummy(constant, dummy), or_dummy(row_factor, dummy), out,
            student.n_rows, c0, c1, cols_per_split, n_s, n_t, a.scale_value, w,
            math.log(w) if inside else 0.0, math.log1p(-w) if inside else 0.0,
            *s_strides, *t_strides, *a.keep_strides,
            out.stride(0) if grad else 0, out.stride(1) if grad else 0,
            DIV=KERNEL_DIVERGENCES.index(plan.row.name), GRAD=grad, HAS_CONSTANT=constant is not None,
            ROW_SCALE=a.scale is not None, HAS_KEEP=a.keep is not None, **b.launch(student.first.dtype),
        )


def column_block_grads(source: Source, dtype: torch.dtype, needs: tuple[bool, ...],
                       write_dz: Callable[[torch.Tensor, int, int], None],
                       block_width: int | None = None) -> tuple[torch.Tensor | None, ...]:
    """(dL/dh, dL/dW) of a hidden-state source from dz written block of columns by block:
    `write_dz(dz, c0, c1)` fills dz [T, c1 − c0] for the valid columns [c0, c1), then two matmuls
    give dW[c0:c1] = dzᵀ·h and dh += dz·W[c0:c1] (see the module docstring). `block_width`:
    columns per block (None: the dz buffer's byte budget, or the op's chunk_size)."""
    hidden, weight = source.hidden, source.weight
    assert hidden is not None and weight is not None  # fused
    n_rows, n_valid = source.n_rows, source.n_valid
    half = hidden.dtype in (torch.bfloat16, torch.float16)
    # dh accumulates over column blocks (fp32: T·H·4 B, H/V of one U); each row of dW is made
    # once by one matmul, so it is written in the weight's dtype directly (the cast the
    # Function would do), not through a [V, H] fp32 buffer
    grad_h = torch.zeros(hidden.shape, dtype=dtype, device=hidden.device) if needs[0] else None
    grad_w = None
    if needs[1]:
        grad_w = torch.empty(weight.shape, dtype=weight.dtype if half else dtype, device=weight.device)
        grad_w[n_valid:].zero_()
    if n_rows == 0 or n_valid == 0:
        if grad_w is not None:
            grad_w.zero_()
        return grad_h, grad_w
    dz_dtype = hidden.dtype if half else dtype  # the matmuls' operand, as in the torch tiles
    budget = CUDA_TILE_BYTES if hidden.device.type == "cuda" else CPU_TILE_BYTES
    # the op's chunk_size (rows per tile elsewhere) caps the block at chunk_size·V_local entries
    entries = source.chunk_rows * n_valid if source.chunk_rows else budget // dz_dtype.itemsize
    width = block_width if block_width is not None else max(1, entries // n_rows)
    buf = torch.empty(n_rows, min(width, n_valid), dtype=dz_dtype, device=hidden.device)
    for c0, c1 in row_chunks(n_valid, width):
        dz = buf[:, : c1 - c0]
        write_dz(dz, c0, c1)
        if grad_w is not None:
            torch.matmul(dz.t(), hidden, out=grad_w[c0:c1])
        if grad_h is not None:
            if half:
                grad_h += torch.matmul(dz, weight[c0:c1])
            else:
                grad_h.addmm_(dz, weight[c0:c1])
    return grad_h, grad_w


def merge_splits(parts: RowStats, splits: int, scale: float | torch.Tensor) -> RowStats:
    """The statistics of `splits` vocabulary splits ([splits·T] rows, split-major) merged into one
    per row: each split's sums moved to the maximum shift over splits and added (the step the
    cross-rank combine takes, :func:`megatron_rl_patches.ops._stats.moved_stats`)."""
    if splits == 1:
        return parts
    n_rows = parts.shift.size(0) // splits

    def view(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(splits, n_rows, *t.shape[1:])

    def view_opt(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else view(t)

    views = dataclasses.replace(parts, shift=view(parts.shift), marked=view(parts.marked), rest=view_opt(parts.rest),
                                moment=view_opt(parts.moment), sub_shift=view_opt(parts.sub_shift),
                                sub_sum=view_opt(parts.sub_sum))
    shift = views.shift.amax(0)
    sub_shift = views.sub_shift.amax(0) if views.sub_shift is not None else None
    moved = moved_stats(views, finite_or_zero(shift), None if sub_shift is None else finite_or_zero(sub_shift),
                        per_row(scale))
    return RowStats(shift=shift, marked=views.marked.sum(0),
                    rest=None if moved.rest is None else moved.rest.sum(0),
                    moment=None if moved.moment is None else moved.moment.sum(0),
                    sub_shift=sub_shift, sub_sum=None if moved.sub_sum is None else moved.sub_sum.sum(0))


def _block(source: Source, r0: int, r1: int, c0: int, c1: int) -> Source:
    """The source's rows [r0, r1) and valid columns [c0, c1) (views: the kernel reads them where
    they are; c0 a whole number of tiles, so each tile is the one a single launch computes)."""
    if source.fused:
        assert source.hidden is not None and source.weight is not None  # fused
        return dataclasses.replace(source, n_valid=c1 - c0, hidden=source.hidden[r0:r1], weight=source.weight[c0:c1])
    assert source.logits is not None  # not fused
    return dataclasses.replace(source, n_valid=c1 - c0, logits=source.logits[r0:r1, c0:c1])
