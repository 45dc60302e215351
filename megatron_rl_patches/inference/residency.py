"""Where an inference-only model's weights live between uses: "resident" (on the device, as
built), "swap" (in host memory; the whole model on the device for a phase or a forward) or
"stream" (in host memory; each layer, the embedding and the head brought in just before they run,
`prefetch` layers ahead, and released after). `hold(module)` pins pieces for a caller that
schedules the work itself (layer-major scoring); `ResidencyBudget` caps several builds together."""
from __future__ import annotations

import contextlib
import functools
import numbers
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from megatron_rl_patches._chunks import as_chunks, has_grad_buffers, unwrap
from megatron_rl_patches.inference.guard import is_inference_only
from megatron_rl_patches.inference.host_init import move_all_but
from megatron_rl_patches.inference.residency_budget import ResidencyBudget
from megatron_rl_patches.inference.residency_storage import HostWeights, device_weight_bytes, log_fallback
from megatron_rl_patches.inference.residency_units import Unit, stream_units, whole_unit

RESIDENCY_MODES = ("resident", "swap", "stream")
ATTR = "_mrp_residency"

_CONTROLLERS: weakref.WeakSet[Residency] = weakref.WeakSet()


def check_residency_args(residency: Any, prefetch: Any, budget: Any) -> str:
    """The residency mode after checking the three build arguments (ValueError/TypeError naming them)."""
    if residency not in RESIDENCY_MODES:
        raise ValueError(f"residency must be one of {', '.join(map(repr, RESIDENCY_MODES))}, got {residency!r}")
    if isinstance(prefetch, bool) or not isinstance(prefetch, numbers.Integral) or prefetch < 0:
        raise ValueError(
            f"prefetch must be an int >= 0 (layers copied ahead of the one running: 0 = none, 1 = the "
            f"next layer, ...), got {prefetch!r}"
        )
    if budget is not None and not isinstance(budget, ResidencyBudget):
        raise TypeError(
            f"budget must be a ResidencyBudget (shared by the builds it caps) or None, got {type(budget).__name__}"
        )
    if budget is not None and residency == "resident":
        raise ValueError(
            "budget= caps the device bytes of residency='swap' or 'stream' builds; a resident build "
            "cannot give its weights back: pass residency='swap' or 'stream', or no budget"
        )
    return str(residency)


def _refuse_trainable(chunks: list[torch.nn.Module]) -> None:
    for index, chunk in enumerate(chunks):
        if has_grad_buffers(chunk) or any(hasattr(p, "main_grad") for p in chunk.parameters()):
            raise TypeError(
                f"model chunk {index} is DDP-wrapped (it has a grad buffer): weights that leave the "
                "device need a frozen model; build it with build_inference_model(..., residency=...)"
            )
        if not is_inference_only(chunk) or any(p.requires_grad for p in chunk.parameters()):
            raise TypeError(
                f"model chunk {index} is trainable: residency applies to frozen models only (a "
                "training step would read released weights); build it with build_inference_model(..., residency=...)"
            )


class Residency:
    """The residency of one build (all its chunks): units, host copies, hooks and counters."""

    def __init__(self, chunks: list[torch.nn.Module], mode: str, prefetch: int, budget: ResidencyBudget | None,
                 device: torch.device, name: str):
        self.name = name
        self.prefetch = int(prefetch)
        self.budget = budget
        all_params = [p for chunk in chunks for p in chunk.parameters()]
        total = device_weight_bytes(all_params)
        self.resident_bytes = total
        if mode == "swap" and budget is not None and total > budget.bytes:
            log_fallback(name, total, budget.bytes)
            mode = "stream"
        self.mode = mode
        self.chunk_units: list[list[Unit]] = [
            [whole_unit(chunk, i)] if mode == "swap" else stream_units(chunk, i) for i, chunk in enumerate(chunks)
        ]
        covered = {id(p) for unit in self.units for p in unit.params}
        self.rest = [p for p in dict.fromkeys(all_params) if id(p) not in covered]  # stay on the device
        rest_bytes = device_weight_bytes(self.rest)
        if budget is not None:
            largest = max(self.units, key=lambda u: u.nbytes)
            if largest.nbytes + rest_bytes > budget.bytes:
                raise ValueError(
                    f"budget of {budget.bytes} bytes is smaller than the largest single piece of model "
                    f"{name!r}: {largest.name} needs {largest.nbytes} bytes (+ {rest_bytes} bytes that stay "
                    "on the device); give ResidencyBudget at least that many bytes"
                )
            if not budget.make_room(rest_bytes, self):
                raise ValueError(
                    f"budget of {budget.bytes} bytes is in use; {name!r} needs {rest_bytes} bytes that stay "
                    "on the device"
                )
        streamed = [p for unit in self.units for p in unit.params]
        move_all_but(chunks, device, {id(p) for p in streamed})
        self.host = HostWeights(streamed, device)
        self.counts: dict[int, int] = {}
        self.device_bytes = rest_bytes
        self.peak_device_bytes = rest_bytes
        self.copies = 0
        self.bytes_moved = 0
        self.activation_bytes = 0
        self.peak_activation_bytes = 0
        if budget is not None:
            budget.charge(rest_bytes)
            budget.join(self)
        self._install_hooks(chunks)
        _CONTROLLERS.add(self)

    # ------------------------------------------------------------------ units

    @property
    def units(self) -> list[Unit]:
        return [unit for units in self.chunk_units for unit in units]

    def cached_units(self) -> list[Unit]:
        return [unit for unit in self.units if unit.cached]

    def _charge(self, nbytes: int) -> None:
        self.device_bytes += nbytes
        self.peak_device_bytes = max(self.peak_device_bytes, self.device_bytes)
        if self.budget is not None:
            self.budget.charge(nbytes)

    def own(self, unit: Unit, optional: bool = False) -> bool:
        """Make `unit`'s weights present (copying what is absent); False when `optional` and the
        budget has no room (a prefetch then waits for its turn)."""
        if unit.active:
            return True
        if unit.cached:
            unit.cached = False  # still on the device: no copy
            return True
        absent = [p for p in unit.params if self.counts.get(id(p), 0) == 0]
        need = sum(p.numel() * p.element_size() for p in absent)
        if self.budget is not None and not self.budget.make_room(need, self):
            if optional:
                return False
            raise RuntimeError(
                f"ResidencyBudget of {self.budget.bytes} bytes is full ({self.budget.in_use} in use by "
                f"pieces running or held): {self.name}.{unit.name} needs {need} more bytes. Release "
                "holds/on_device blocks of other models first, or raise the budget"
            )
        for param in unit.params:
            self.counts[id(param)] = self.counts.get(id(param), 0) + 1
        if absent:
            unit.event = self.host.restore(absent)
            unit.copies += 1
            self.copies += 1
            self.bytes_moved += need
            self._charge(need)
        return True

    def disown(self, unit: Unit) -> None:
        """`unit` is no longer in use: a budgeted swap model stays cached (evictable), else freed."""
        if unit.active:
            return
        if self.budget is not None and self.mode == "swap":
            unit.cached = True
            unit.last_used = self.budget.tick()
        else:
            self.evict(unit)

    def evict(self, unit: Unit) -> None:
        """Free the weights only `unit` holds."""
        unit.cached = False
        self.host.wait(unit.event)  # never free a storage a copy is still writing
        unit.event = None
        freed = 0
        for param in unit.params:
            self.counts[id(param)] -= 1
            if self.counts[id(param)] == 0:
                freed += param.numel() * param.element_size()
                self.host.release(param)
        self._charge(-freed)

    def ready(self, unit: Unit) -> None:
        if unit.event is not None:
            self.host.wait(unit.event)
            unit.event = None

    # ------------------------------------------------------------------ hooks

    def chunk_index(self, chunk: torch.nn.Module) -> int:
        """Which of this build's chunks `chunk` is (the chunk or the model it wraps)."""
        for index, (outer, inner) in enumerate(zip(self.chunks, self.inner)):
            if chunk is outer or chunk is inner:
                return index
        raise ValueError(f"{type(chunk).__name__} is not a model chunk of {self.name!r}")

    def _install_hooks(self, chunks: list[torch.nn.Module]) -> None:
        self.chunks = list(chunks)
        self.inner = [unwrap(chunk) for chunk in chunks]
        for ci, chunk in enumerate(chunks):
            object.__setattr__(chunk, ATTR, self)
            object.__setattr__(self.inner[ci], ATTR, self)
            units = self.chunk_units[ci]
            if self.mode == "swap":
                chunk.register_forward_pre_hook(functools.partial(self._enter, ci, 0))
            else:
                for k, unit in enumerate(units):
                    for module in unit.modules:
                        module.register_forward_pre_hook(functools.partial(self._enter, ci, k))
                    # on an exception the chunk's own hook below releases it: the output-processor
                    # backport stops GPTModel at its output layer by raising, then reads the weight
                    unit.modules[-1].register_forward_hook(functools.partial(self._leave, ci, k))
            chunk.register_forward_hook(functools.partial(self._end_forward, ci), always_call=True)

    def _enter(self, ci: int, k: int, module: torch.nn.Module, args: Any) -> None:
        units = self.chunk_units[ci]
        unit = units[k]
        if not unit.active:
            self.own(unit)
            unit.streamed = True
        elif unit.holds == 0:
            unit.streamed = True
        if unit.holds == 0:
            for ahead in units[k + 1 : k + 1 + self.prefetch]:
                if not ahead.active and self.own(ahead, optional=True):
                    ahead.streamed = True
        if self.budget is not None:
            unit.last_used = self.budget.tick()
        self.ready(unit)

    def _leave(self, ci: int, k: int, module: torch.nn.Module, args: Any, output: Any) -> None:
        self._finish(self.chunk_units[ci][k])

    def _end_forward(self, ci: int, module: torch.nn.Module, args: Any, output: Any) -> None:
        """After the chunk's forward (or its exception): nothing brought in for it stays."""
        self.release_streamed(ci)

    def release_streamed(self, ci: int | None = None) -> None:
        """Release what the stream schedule brought in (prefetched pieces included) and nobody holds."""
        for index, units in enumerate(self.chunk_units):
            if ci is None or index == ci:
                for unit in units:
                    self._finish(unit)

    def _finish(self, unit: Unit) -> None:
        if unit.streamed:
            unit.streamed = False
            self.disown(unit)

    def hold(self, units: list[Unit]) -> None:
        for unit in units:
            self.own(unit)
            unit.holds += 1

    def unhold(self, units: list[Unit]) -> None:
        for unit in units:
            unit.holds -= 1
            self.disown(unit)


def residency_of(chunks: Any) -> Residency | None:
    """The Residency of a build (its chunks, one chunk, or a module inside it), None for a resident one."""
    for chunk in as_chunks(chunks):
        found = getattr(chunk, ATTR, None)
        if isinstance(found, Residency):
            return found
    return None


def attach_residency(chunks: Sequence[torch.nn.Module], residency: str, *, prefetch: int = 1,
                     budget: ResidencyBudget | None = None, device: torch.device | None = None,
                     name: str = "model") -> list[torch.nn.Module]:
    """Move the weights of frozen `chunks` to host memory under `residency` ("swap" or "stream";
    "resident" leaves them as they are). build_inference_model calls it; returns the chunks."""
    mode = check_residency_args(residency, prefetch, budget)
    chunks = list(chunks)
    _refuse_trainable(chunks)
    if mode == "resident":
        return chunks
    if residency_of(chunks) is not None:
        raise ValueError("these model chunks already have a residency; build the model again to change it")
    target = device if device is not None else torch.device("cpu")
    Residency(chunks, mode, prefetch, budget, target, name)
    return chunks


def module_list(chunks: Any, argument: str) -> list[torch.nn.Module]:
    found = as_chunks(chunks)
    if not found or not all(isinstance(c, torch.nn.Module) for c in found):
        raise TypeError(f"{argument} must be a torch.nn.Module or a list of model chunks, got {type(chunks).__name__}")
    return found


@contextlib.contextmanager
def on_device(chunks: Any) -> Iterator[None]:
    """A scoring phase: a swap model's weights stay on the device inside (one copy in, one
    release out). A stream model keeps streaming (nothing held); a resident model: a no-op."""
    module_list(chunks, "chunks")
    owner = residency_of(chunks)
    if owner is None or owner.mode != "swap":
        yield
        return
    units = [unit for chunk in as_chunks(chunks) for unit in owner.chunk_units[owner.chunk_index(chunk)]]
    owner.hold(units)
    try:
        yield
    finally:
        owner.unhold(units)


def _covering(module: torch.nn.Module) -> tuple[Residency, list[Unit]] | None:
    inside = {id(m) for m in module.modules()}
    for owner in list(_CONTROLLERS):
        units = [
            unit for unit in owner.units
            if any(id(m) in inside or any(sub is module for sub in m.modules()) for m in unit.modules)
        ]
        if units:
            return owner, units
    return None


@contextlib.contextmanager
def hold(module: torch.nn.Module) -> Iterator[None]:
    """Keep the weights of `module` (a layer, the embedding, the head, a chunk) on the device
    inside: one host-to-device copy for the whole block, however many forwards run in it, and the
    stream hooks leave it alone. Nested holds are counted. A no-op for a resident model."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(
            f"hold(module) needs a torch.nn.Module (a layer or chunk of a model), got {type(module).__name__}"
        )
    found = _covering(module)
    if found is None:
        yield
        return
    owner, units = found
    owner.hold(units)
    try:
        yield
    finally:
        owner.unhold(units)


@contextlib.contextmanager
def weights_on_host(chunks: Any) -> Iterator[None]:
    """Inside: a swap/stream build's parameters are their host copies (not the device storage), so
    a loader writes the weights where they live; a resident build: a no-op. Nothing may be on the
    device meanwhile (no hold, on_device block or forward under way)."""
    owner = residency_of(module_list(chunks, "chunks"))
    if owner is None:
        yield
        return
    for unit in owner.units:
        if unit.cached:
            owner.evict(unit)
    busy = [unit.name for unit in owner.units if unit.active]
    if busy:
        raise RuntimeError(
            f"cannot load weights into {owner.name!r} while {', '.join(busy)} are on the device (a hold(), "
            "on_device() or forward is under way): load before or after it"
        )
    params, hosts = owner.host.params, owner.host.host
    saved = {key: param.data for key, param in params.items()}
    for key, param in params.items():
        param.data = hosts[key]
    try:
        yield
    finally:
        for key, param in params.items():
            param.data = saved[key]


def release_streamed(chunks: Any) -> None:
    """Send back to host every weight of a swap/stream build that no hold() or on_device() keeps:
    for callers that run its layers themselves (a chunk's own forward does this on return)."""
    owner = residency_of(module_list(chunks, "chunks"))
    if owner is not None:
        owner.release_streamed()


def note_activation_bytes(chunks: Any, nbytes: int) -> None:
    """Record the activation bytes a layer-major scorer keeps on the device now (for the report)."""
    owner = residency_of(chunks)
    if owner is not None:
        owner.activation_bytes = int(nbytes)
        owner.peak_activation_bytes = max(owner.peak_activation_bytes, int(nbytes))
