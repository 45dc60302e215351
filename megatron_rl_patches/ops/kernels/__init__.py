"""Backends of the vocabulary ops, and the contract every backend implements (public here).

A backend (the torch tiles, the Triton kernels, a float64 test backend) turns a
:class:`~megatron_rl_patches.ops.kernels.sources.Source` of logits (materialized logits, or hidden
states and an output-weight shard) into per-row statistics and gradients; everything else (the
cross-rank combine, the outputs, the autograd Functions, every public op) is shared, so a backend
computes nothing else. Subclass :class:`Backend` and :func:`register_backend` it:

- ``name``; ``available(device)``: None when it can run there, else why not (one line);
  ``claims(device)``: whether ``auto`` should pick it. ``available_for(device, dtype)`` /
  ``claims_for(device, dtype)`` see the inputs' dtype too (default: the device-only answers);
- forward: ``row_stats(source, stats, cols, owned, keep_mask, scale) -> RowStats``: every tile of
  the rank's vocabulary shard folded into `stats` (empty, with the sums wanted), in any order and
  tiling; `cols`/`owned` [T, k] are the marked ids' local columns;
- backward: ``apply_grad(source, factors, scale, keep_mask, needs) -> gradients`` in the compute
  dtype (the logits' gradient, or ``(dh for every gathered row, dW)``; `needs` says which), each
  tile's dL/dx being ``_stats.tile_grad``'s formula from the saved :class:`GradFactors`;
- optional (the base class's defaults): ``combined_stats(..., group)``, the statistics over the
  tensor-parallel group (default: ``row_stats`` then one MAX and one SUM all-reduce; a backend
  that needs the rows' global maxima between its passes does its own all-reduces here);
  ``finalize(step, n_rows, *args)``, the per-row math after the combine (default: one call);
  ``topk(source, run, first_id)``, the top-k ids (default: the torch tiles'); ``tie_tiles``, the
  tiles of tied rows recomputed (default: in the row tile each had);
  ``serves_divergence(student, teachers, plan)`` (default False) with ``divergence_sums`` /
  ``divergence_grad``, lm_head_divergence's pass 2 and backward (the divergence table's terms;
  when not served the torch tiles evaluate the table).

Units: ``u = (x - shift)·s`` with s = 1/τ per row. ``torch`` (tiles of torch ops, every device and
dtype) and ``triton`` (CUDA, or CPU under ``TRITON_INTERPRET=1``) are built in. Choice per call:
the op's ``backend=`` argument, else ``MEGATRON_RL_PATCHES_BACKEND``, else ``auto`` (the last
registered backend that claims the inputs' device and dtype, ``torch`` last). The invariant mode
(an op's resolved ``invariant=True``) takes precedence: its forward statistics and top-k ids come
from :class:`~.invariant_tiles.InvariantTiles` over the choice, which still gives the gradients
(and is still checked), unless the choice has its own invariant kernels
(``invariant_backend()``, optional; the Triton backend's:
:class:`~.triton.invariant_backend.InvariantTriton`). A backend written
against the earlier protocol (a plain class with ``available(device)`` / ``claims(device)``, no
base class) still registers: its members are read once, at registration.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from megatron_rl_patches import settings
from megatron_rl_patches.ops._stats import GradFactors, RowStats
from megatron_rl_patches.ops.kernels.contract import Backend
from megatron_rl_patches.ops.kernels.invariant_tiles import InvariantTiles
from megatron_rl_patches.ops.kernels.native.backend import InvariantNative
from megatron_rl_patches.ops.kernels.native.build import native_library
from megatron_rl_patches.ops.kernels.sources import Source
from megatron_rl_patches.ops.kernels.torch_tiles import TorchTiles
from megatron_rl_patches.ops.kernels.triton import LazyTritonTiles, LazyVendorGemm

if TYPE_CHECKING:
    from megatron_rl_patches.ops._divergences import ResolvedDivergence
    from megatron_rl_patches.ops.topk_select import RunningTopk

__all__ = ["Backend", "GradFactors", "RowStats", "Source", "BACKEND_ENV", "register_backend", "resolve_backend",
           "backend_names", "topk_step", "divergence_step"]

BACKEND_ENV = settings.BACKEND
AUTO = settings.AUTO


class _Registered(Backend):
    """A backend written against the earlier protocol (no base class): its members, read once."""

    # the defaults otherwise
    _OPTIONAL = ("topk", "tie_tiles", "serves_divergence", "divergence_sums", "divergence_grad")

    def __init__(self, backend: Any) -> None:
        self.wrapped = backend
        self.name = backend.name
        self.available, self.claims = backend.available, backend.claims  # type: ignore[method-assign]
        self.row_stats, self.apply_grad = backend.row_stats, backend.apply_grad  # type: ignore[method-assign]
        for member in self._OPTIONAL:
            if hasattr(backend, member):
                setattr(self, member, getattr(backend, member))


def topk_step(backend: Backend) -> Callable[[Source, RunningTopk, int], RunningTopk]:
    """The backend's top-k id step (the torch tiles' unless it has its own)."""
    step = backend.topk if backend.topk is not None else _REGISTRY["torch"].topk
    assert step is not None  # the torch tiles have one
    return step


def divergence_step(backend: Backend, student: Source, teachers: list[Source],
                    plan: ResolvedDivergence) -> Backend | None:
    """The backend when it serves lm_head_divergence's pass 2 and backward for these sources and
    this table row, else None (the torch tiles evaluate the table's formula)."""
    return backend if backend.serves_divergence(student, teachers, plan) else None


_REGISTRY: dict[str, Backend] = {}


def register_backend(backend: Backend | Any) -> Backend:
    """Make `backend` selectable by its name (registered later = tried earlier by ``auto``); a
    backend without the base class is read once here. Returns what the ops will call."""
    registered = backend if isinstance(backend, Backend) else _Registered(backend)
    _REGISTRY[registered.name] = registered
    return registered


def backend_names() -> tuple[str, ...]:
    return ("auto", *_REGISTRY)


def resolve_backend(name: object, device: torch.device, dtype: torch.dtype | None = None,
                    invariant: bool = False) -> Backend:
    """The backend for a call on `device` with inputs of `dtype` (None: any): `name`, or the
    environment's choice, or ``auto``; with `invariant` the invariant tiles over it (its gradients)."""
    chosen = _chosen_backend(name, device, dtype)
    if not invariant:
        return chosen
    own = chosen.invariant_backend()
    if own is not None:
        return own
    library = native_library() if device.type == "cpu" else None
    return InvariantNative(chosen, library) if library is not None else InvariantTiles(chosen)


def _chosen_backend(name: object, device: torch.device, dtype: torch.dtype | None) -> Backend:
    if name is None or name == AUTO:
        # the launcher and `doctor` read the variable with this same parser (case, spaces, "auto")
        name = settings.backend(known=_REGISTRY)
        where = f"{BACKEND_ENV}={name!r}"
    else:
        where = f"backend={name!r}"
    if not isinstance(name, str) or name not in backend_names():
        raise ValueError(f"{where} is not a backend; choose one of {', '.join(backend_names())}")
    if name == AUTO:
        return next(b for b in reversed(_REGISTRY.values())
                    if b.claims_for(device, dtype) and b.available_for(device, dtype) is None).loaded()
    backend = _REGISTRY[name]
    why = backend.available_for(device, dtype)
    if why is not None:
        raise ValueError(f"{where} cannot run on {device}: {why}; choose backend='torch' or 'auto'")
    return backend.loaded()


def _register_builtins() -> None:
    register_backend(TorchTiles())
    # always registered (a lazy proxy: nothing of triton is imported here), so that a forced
    # backend='triton' without triton says why it cannot run instead of "not a backend"
    register_backend(LazyTritonTiles())
    register_backend(LazyVendorGemm())


_register_builtins()
