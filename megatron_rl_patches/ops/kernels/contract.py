"""The base class of a backend of the vocabulary ops (the contract is described in
:mod:`megatron_rl_patches.ops.kernels`, which exports it)."""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist

from megatron_rl_patches.ops._stats import GradFactors, RowStats, combine_over_ranks
from megatron_rl_patches.ops.kernels.sources import Source

if TYPE_CHECKING:
    from megatron_rl_patches.ops._divergences import ResolvedDivergence
    from megatron_rl_patches.ops.topk_select import RunningTopk, Tiles

T = TypeVar("T")


class Backend:
    """The base class of a backend (the contract above): the required members raise
    NotImplementedError, the optional ones have their defaults."""

    name: str = ""
    # lm_head_divergence's pass 1: True walks torch tiles once for every model's normalizer (the
    # torch backend), False asks row_stats once per model (a backend with its own kernels)
    divergence_pass1_on_tiles: bool = False

    def available(self, device: torch.device) -> str | None:
        """None when it can run on `device`, else why not (one line, for the error)."""
        return None

    def claims(self, device: torch.device) -> bool:
        """Whether ``auto`` should pick it for tensors on `device`."""
        return False

    def available_for(self, device: torch.device, dtype: torch.dtype | None) -> str | None:
        """As :meth:`available`, for inputs of `dtype` (None: not known; default: any dtype)."""
        return self.available(device)

    def claims_for(self, device: torch.device, dtype: torch.dtype | None) -> bool:
        """As :meth:`claims`, for inputs of `dtype` (None: not known; default: any dtype)."""
        return self.claims(device)

    def row_stats(self, source: Source, stats: RowStats, cols: torch.Tensor, owned: torch.Tensor,
                  keep_mask: torch.Tensor | None, scale: float | torch.Tensor) -> RowStats:
        """Fold every tile of the source's vocabulary shard into `stats` (empty, with the sums
        wanted) and return it: `cols`/`owned` [T, k] the marked ids' local columns."""
        raise NotImplementedError(f"backend {self.name!r} has no row_stats")

    def combined_stats(self, source: Source, stats: RowStats, cols: torch.Tensor, owned: torch.Tensor,
                       keep_mask: torch.Tensor | None, scale: float | torch.Tensor,
                       group: dist.ProcessGroup | None) -> RowStats:
        """The full-vocabulary statistics over the tensor-parallel `group` (None: no TP). Default:
        :meth:`row_stats`, then one MAX and one SUM all-reduce of the ranks' statistics; a backend
        that needs the rows' global maxima between its passes (the invariant tiles) overrides it."""
        return combine_over_ranks(self.row_stats(source, stats, cols, owned, keep_mask, scale), scale, group)

    def finalize(self, step: Callable[..., T], n_rows: int, *args: Any) -> T:
        """``step(*args)``: per-row math over the combined statistics (`n_rows` rows). Default: one
        call; the invariant tiles run it in blocks of a fixed row count."""
        return step(*args)

    def apply_grad(self, source: Source, factors: GradFactors, scale: float | torch.Tensor,
                   keep_mask: torch.Tensor | None, needs: tuple[bool, ...]) -> tuple[torch.Tensor | None, ...]:
        """The gradients of the source's tensors (`needs` says which) in the compute dtype: the
        logits' gradient, or (dL/dh for every gathered row, dL/dW)."""
        raise NotImplementedError(f"backend {self.name!r} has no apply_grad")

    # Optional: `topk(source, run, first_id) -> RunningTopk`, the source's k best ids merged into
    # `run` (see :mod:`megatron_rl_patches.ops.topk_select`; a column a tile left out at a tied cut
    # raises `run.ambiguous` to that value). None: the torch tiles' (`kernels.topk_step`).
    topk: Callable[[Source, RunningTopk, int], RunningTopk] | None = None
    # Optional: `tie_tiles(source, index, dtype) -> Tiles`, the logits tiles of the rows `index`
    # (a fused source's; ascending) recomputed with the bits `topk` saw, for rows whose k-th id is
    # tied. None: each row recomputed in the row tile it had (the torch tiles' shapes).
    tie_tiles: Callable[[Source, torch.Tensor, torch.dtype], Tiles] | None = None

    def invariant_backend(self) -> Backend | None:
        """Its own kernels for the invariant mode (each row's bits from that row alone), or None:
        the torch invariant tiles run the forward over it (:func:`..resolve_backend`)."""
        return None

    def loaded(self) -> Backend:
        """What the ops call: the backend itself (a lazy proxy: the backend it stands for)."""
        return self

    def serves_divergence(self, student: Source, teachers: list[Source], plan: ResolvedDivergence) -> bool:
        """Whether :meth:`divergence_sums` / :meth:`divergence_grad` take this call (one pair of
        sources, student and teacher; the table row of `plan`). Default: never."""
        return False

    def divergence_sums(self, student: Source, teacher: Source, norms: tuple[torch.Tensor, ...],
                        plan: ResolvedDivergence, scale: float | torch.Tensor,
                        keep_mask: torch.Tensor | None) -> torch.Tensor:
        """[T, 2]: this shard's share of the divergence and of G = Σ g per row (pass 2); `norms`
        each model's [2, T] normalizers (shifts then log S, combined over the ranks)."""
        raise NotImplementedError(f"backend {self.name!r} serves no divergence")

    def divergence_grad(self, student: Source, teacher: Source, norms: tuple[torch.Tensor, ...],
                        plan: ResolvedDivergence, scale: float | torch.Tensor, keep_mask: torch.Tensor | None,
                        constant: torch.Tensor | None, row_factor: torch.Tensor,
                        needs: tuple[bool, ...]) -> tuple[torch.Tensor | None, ...]:
        """(dL/dh, dL/dW) of the student from dz = (g − p·G)·row_factor (G = `constant`, None: 0)."""
        raise NotImplementedError(f"backend {self.name!r} serves no divergence")
