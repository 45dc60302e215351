"""Backends of the vocabulary ops: each produces row statistics (forward) and gradients from saved
row factors (backward) for a source of logits (see :mod:`megatron_rl_patches.ops._stats` for the
contract). ``torch`` (tiles of torch ops, every device) and ``triton`` (Triton kernels: CUDA, or
CPU under ``TRITON_INTERPRET=1``) are built in; more register by name.

Choice per call: the op's ``backend=`` argument, else ``MEGATRON_RL_PATCHES_BACKEND``, else
``auto`` (the first registered backend that claims the tensors' device, ``torch`` last).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, cast

import torch

from megatron_rl_patches._backend_env import AUTO, VARIABLE, environment_backend
from megatron_rl_patches.ops._stats import GradFactors, RowStats
from megatron_rl_patches.ops.kernels.sources import Source

if TYPE_CHECKING:
    from megatron_rl_patches.ops._divergences import Plan
    from megatron_rl_patches.ops.topk_select import RunningTopk

BACKEND_ENV = VARIABLE


class Backend(Protocol):
    """What a backend provides (see the contract in :mod:`megatron_rl_patches.ops._stats`)."""

    name: str

    def available(self, device: torch.device) -> str | None:
        """None when it can run on `device`, else why not (one line, for the error)."""

    def claims(self, device: torch.device) -> bool:
        """Whether ``auto`` should pick it for tensors on `device`."""

    def row_stats(self, source: Source, stats: RowStats, cols: torch.Tensor, owned: torch.Tensor,
                  keep_mask: torch.Tensor | None, scale: float | torch.Tensor) -> RowStats:
        """Fold every tile of the source's vocabulary shard into `stats` (empty, with the sums
        wanted) and return it: `cols`/`owned` [T, k] the marked ids' local columns."""

    def apply_grad(self, source: Source, factors: GradFactors, scale: float | torch.Tensor,
                   keep_mask: torch.Tensor | None, needs: tuple[bool, ...]) -> tuple[torch.Tensor | None, ...]:
        """The gradients of the source's tensors (`needs` says which) in the compute dtype: the
        logits' gradient, or (dL/dh for every gathered row, dL/dW)."""

    # Optional: `topk(source, run, first_id) -> RunningTopk`, the source's k best ids merged into
    # `run` (see :mod:`megatron_rl_patches.ops.topk_select`; a column a tile left out at a tied cut
    # raises `run.ambiguous` to that value). A backend without it gets the torch tiles' (topk_step).
    # Optional: the steps of :class:`DivergenceKernels` (lm_head_divergence's pass 2 and backward).


def topk_step(backend: Backend) -> Callable[[Source, RunningTopk, int], RunningTopk]:
    """The backend's top-k id step, or the torch tiles' when it has none (a backend registered
    before the top-k ops took `backend=`)."""
    step = getattr(backend, "topk", None)
    return step if step is not None else _REGISTRY["torch"].topk  # type: ignore[attr-defined]


class DivergenceKernels(Protocol):
    """A backend's optional steps of lm_head_divergence (one pair of sources, student and teacher,
    each model's normalizers `norms` [2, T]: shifts then log S, combined over the ranks). The
    per-entry terms are the divergence table's (:mod:`megatron_rl_patches.ops._divergences`);
    without these steps the torch tiles evaluate it."""

    def serves_divergence(self, student: Source, teachers: list[Source]) -> bool:
        """Whether it takes a call with these sources (else the torch tiles do)."""

    def divergence_sums(self, student: Source, teacher: Source, norms: tuple[torch.Tensor, ...], plan: Plan,
                        scale: float | torch.Tensor, keep_mask: torch.Tensor | None) -> torch.Tensor:
        """[T, 2]: this shard's share of the divergence and of G = Σ g per row (pass 2)."""

    def divergence_grad(self, student: Source, teacher: Source, norms: tuple[torch.Tensor, ...], plan: Plan,
                        scale: float | torch.Tensor, keep_mask: torch.Tensor | None, constant: torch.Tensor | None,
                        row_factor: torch.Tensor, needs: tuple[bool, ...]) -> tuple[torch.Tensor | None, ...]:
        """(dL/dh, dL/dW) of the student from dz = (g − p·G)·row_factor (G = `constant`, None: 0)."""


def divergence_step(backend: Backend, student: Source, teachers: list[Source]) -> DivergenceKernels | None:
    """The backend when it serves lm_head_divergence's pass 2 and backward for these sources,
    else None (the torch tiles evaluate the table's formula)."""
    serves = getattr(backend, "serves_divergence", None)
    return cast(DivergenceKernels, backend) if serves is not None and serves(student, teachers) else None


_REGISTRY: dict[str, Backend] = {}


def register_backend(backend: Backend) -> None:
    """Make `backend` selectable by its name (registered later = tried earlier by ``auto``)."""
    _REGISTRY[backend.name] = backend


def backend_names() -> tuple[str, ...]:
    return ("auto", *_REGISTRY)


def resolve_backend(name: object, device: torch.device) -> Backend:
    """The backend for a call on `device`: `name`, or the environment's choice, or ``auto``."""
    if name is None or name == AUTO:
        # the launcher and `doctor` read the variable with this same parser (case, spaces, "auto")
        name = environment_backend(known=_REGISTRY)
        where = f"{BACKEND_ENV}={name!r}"
    else:
        where = f"backend={name!r}"
    if not isinstance(name, str) or name not in backend_names():
        raise ValueError(f"{where} is not a backend; choose one of {', '.join(backend_names())}")
    if name == AUTO:
        return next(b for b in reversed(_REGISTRY.values()) if b.claims(device) and b.available(device) is None)
    backend = _REGISTRY[name]
    why = backend.available(device)
    if why is not None:
        raise ValueError(f"{where} cannot run on {device}: {why}; choose backend='torch' or 'auto'")
    return backend


def _register_builtins() -> None:
    from megatron_rl_patches.ops.kernels.torch_tiles import TorchTiles
    from megatron_rl_patches.ops.kernels.triton import LazyTritonTiles

    register_backend(TorchTiles())
    # always registered (a lazy proxy: nothing of triton is imported here), so that a forced
    # backend='triton' without triton says why it cannot run instead of "not a backend"
    register_backend(LazyTritonTiles())


_register_builtins()
