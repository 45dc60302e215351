"""What launching a Triton kernel of this backend takes: tile sizes per device, the forward grid's
vocabulary splits, and the kernels' arguments made from the ops' tensors (shared by the default
kernels, :mod:`.backend`, and the invariant mode's, :mod:`.invariant_backend`)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megatron_rl_patches import settings
from megatron_rl_patches.ops.kernels.sources import Source

# Triton picks the interpreter when a kernel is decorated, i.e. when this module is imported.
INTERPRETED = settings.triton_interpreted()


@dataclass(frozen=True)
class Blocks:
    """Tile sizes and launch options of one kernel family on one device."""

    m: int
    n: int
    k: int
    warps: int
    stages: int

    def launch(self, dtype: torch.dtype) -> dict[str, int | bool | str]:
        """Kernel keywords for inputs of `dtype`: fp32 products in ieee precision (torch's default
        for matmuls), and, under the interpreter only, operands upcast before tl.dot (its bf16
        dot is wrong, see _tiles.logits_tile)."""
        return {"BLOCK_M": self.m, "BLOCK_N": self.n, "BLOCK_K": self.k, "num_warps": self.warps,
                "num_stages": self.stages, "DOT_FP32": INTERPRETED,
                "DOT_PRECISION": "ieee" if dtype == torch.float32 else "tf32"}


def blocks(device: torch.device, fused: bool) -> Blocks:
    """Untuned defaults (run once on an H200, not tuned): fused tiles sized for the tensor cores, logits
    tiles wide rows for bandwidth; the interpreter gets the smallest legal tiles (tl.dot needs 16)."""
    if device.type != "cuda" or INTERPRETED:
        return Blocks(16, 16, 16, 1, 1)
    return Blocks(64, 128, 64, 8, 3) if fused else Blocks(16, 512, 16, 8, 2)


def splits_for(n_rows: int, n_cols: int, b: Blocks, device: torch.device) -> int:
    """Vocabulary splits of the forward grid: enough programs for two waves of the GPU's SMs.
    Under the interpreter up to 2, so the split merge is exercised by the tests."""
    row_blocks = math.ceil(n_rows / b.m)
    col_tiles = math.ceil(n_cols / b.n)
    if device.type == "cuda" and not INTERPRETED:
        target = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    else:
        target = 2 * row_blocks
    return max(1, min(col_tiles, math.ceil(target / row_blocks)))


def column_splits(n_rows: int, n_cols: int, b: Blocks, device: torch.device) -> tuple[int, int]:
    """(splits, columns per split) of the forward grid: :func:`splits_for`'s count, each split a
    whole number of BLOCK_N tiles (so the last may come out fewer)."""
    cols_per_split = math.ceil(math.ceil(n_cols / splits_for(n_rows, n_cols, b, device)) / b.n) * b.n
    return math.ceil(n_cols / cols_per_split), cols_per_split


def scale_args(scale: float | torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor | None, float]:
    if isinstance(scale, torch.Tensor):
        return scale.reshape(-1).to(dtype).contiguous(), 1.0
    return None, float(scale)


def marks_arg(cols: torch.Tensor, owned: torch.Tensor) -> torch.Tensor:
    """[T, k] int32 local columns, -1 where another rank owns the id."""
    return torch.where(owned, cols, -1).to(torch.int32).contiguous()


def keep_arg(keep_mask: torch.Tensor | None) -> tuple[torch.Tensor | None, int, int]:
    if keep_mask is None:
        return None, 0, 0
    keep = keep_mask.view(torch.int8) if keep_mask.dtype == torch.bool else (keep_mask != 0).to(torch.int8)
    return keep, keep.stride(0), keep.stride(1)


def src_args(source: Source) -> tuple[torch.Tensor, torch.Tensor, int, int, int, int, int]:
    """(src, weight, hidden size, src strides, weight strides): the weight is a dummy for logits."""
    if source.fused:
        h, w = source.hidden, source.weight
        assert h is not None and w is not None  # fused
        return h, w, h.size(1), h.stride(0), h.stride(1), w.stride(0), w.stride(1)
    x = source.logits
    assert x is not None  # not fused
    return x, x, 0, x.stride(0), x.stride(1), 0, 0


@dataclass(frozen=True)
class TileArgs:
    """A launch's per-row arguments made from the op's tensors: the kept columns (int8, with its
    strides), the marked ids' local columns and 1/τ per row; None where the call has none (the
    kernel's flag off), `scale_value` the one 1/τ of every row when `scale` is None."""

    keep: torch.Tensor | None
    keep_strides: tuple[int, int]
    marks: torch.Tensor | None
    scale: torch.Tensor | None
    scale_value: float

    def pointers(self, dummy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(keep, marks, scale) as kernel arguments, `dummy` for each one absent."""
        keep, marks, scale = (dummy if t is None else t for t in (self.keep, self.marks, self.scale))
        return keep, marks, scale


def tile_args(keep_mask: torch.Tensor | None, scale: float | torch.Tensor, dtype: torch.dtype,
              marked: tuple[torch.Tensor, torch.Tensor] | None = None) -> TileArgs:
    """The launch's `TileArgs`: `marked` the marked ids' (local columns, owned here) when it has any."""
    keep, s_keep_r, s_keep_c = keep_arg(keep_mask)
    scale_t, scale_v = scale_args(scale, dtype)
    return TileArgs(keep, (s_keep_r, s_keep_c), None if marked is None else marks_arg(*marked), scale_t, scale_v)


def or_dummy(t: torch.Tensor | None, dummy: torch.Tensor) -> torch.Tensor:
    """A kernel argument for an optional tensor (flagged off in the kernel when absent)."""
    return dummy if t is None else t.contiguous()
