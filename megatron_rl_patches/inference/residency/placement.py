"""Where an inference-only model's weights live between uses: "resident" (on the device, as
built), "swap" (in host memory; the whole model on the device for a phase or a forward) or
"stream" (in host memory; each layer, the embedding and the head brought in just before they run,
`prefetch` layers ahead, and released after). `hold(module)` pins pieces for a caller that
schedules the work itself (layer-major scoring); `ResidencyBudget` caps several builds together.

Between uses a parameter's `.data` is its host copy (residency/storage.py), so user code never
meets a released storage. Each piece is reference-counted, and each chunk forward runs in a scope
whose pieces are released however it ends (BaseException included), so nested and re-entrant
forwards keep what their callers still use."""
from __future__ import annotations

import contextlib
import copy
import functools
import numbers
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from megatron_rl_patches.inference.guard import is_inference_only
from megatron_rl_patches.inference.residency.budget import ResidencyBudget
from megatron_rl_patches.inference.residency.host_init import move_all_but
from megatron_rl_patches.inference.residency.storage import HostWeights, device_weight_bytes, log_fallback, nbytes_of
from megatron_rl_patches.inference.residency.units import Unit, stream_units, whole_unit
from megatron_rl_patches.model.chunks import as_chunks, has_grad_buffers, unwrap
from megatron_rl_patches.settings import check_residency

ATTR = "_mrp_residency"

_CONTROLLERS: weakref.WeakSet[Residency] = weakref.WeakSet()


def check_residency_args(residency: Any, prefetch: Any, budget: Any) -> str:
    """The residency mode after checking the three build arguments (ValueError/TypeError naming them)."""
    check_residency(residency)
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


class _Scope:
    """What one forward of a chunk (or the layers a caller runs outside one) acquired: units
    running, units prefetched, and multi-module units waiting for their last module."""

    def __init__(self) -> None:
        self.running: list[Unit] = []
        self.prefetched: list[Unit] = []
        self.pending: set[Unit] = set()


def _input_tensors(args: Any, kwargs: Any) -> Iterator[torch.Tensor]:
    for value in (*args, *(kwargs or {}).values()):
        inner = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else (value,)
        yield from (t for t in inner if isinstance(t, torch.Tensor))


class _ScopedForward:
    """The model's forward inside a residency scope: whatever ends it (an Exception,
    KeyboardInterrupt, SystemExit), everything the forward brought in is released."""

    def __init__(self, owner: Residency, index: int, model: torch.nn.Module, previous: Any):
        self.owner, self.index, self.model, self.previous = owner, index, model, previous

    @property
    def __wrapped__(self) -> Any:  # inspect.signature reads the model's own forward
        return self.previous if self.previous is not None else type(self.model).forward.__get__(self.model)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.owner.run_chunk(self.index, self.__wrapped__, args, kwargs)


class Residency:
    """The residency of one build (all its chunks): units, host copies, hooks and counters. Each
    unit is reference-counted (holds, forwards, nested and re-entrant forwards), so a piece leaves
    the device only when its last user is done."""

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
        self._start(rest_bytes)
        self._install_hooks(chunks)

    def _start(self, rest_bytes: int) -> None:
        self.counts: dict[int, int] = {}
        self.scopes: list[_Scope] = []
        self.loose = _Scope()  # layers run by a caller outside a chunk forward
        self.device_bytes = rest_bytes
        self.peak_device_bytes = rest_bytes
        self.copies = 0
        self.bytes_moved = 0
        self.activation_bytes = 0
        self.peak_activation_bytes = 0
        if self.budget is not None:
            self.budget.charge(rest_bytes)
            self.budget.join(self)
        _CONTROLLERS.add(self)

    def __deepcopy__(self, memo: dict[int, Any]) -> Residency:
        """The residency of a deep copy of the model: same mode, prefetch and budget (shared), its
        own host copies (the copied parameters' values), nothing on the device."""
        clone = object.__new__(Residency)
        memo[id(self)] = clone
        if self.budget is not None:
            memo[id(self.budget)] = self.budget
        clone.name, clone.prefetch, clone.budget, clone.mode = self.name, self.prefetch, self.budget, self.mode
        clone.resident_bytes = self.resident_bytes
        clone.chunk_units = [
            [Unit(u.name, copy.deepcopy(u.modules, memo), copy.deepcopy(u.params, memo)) for u in units]
            for units in self.chunk_units
        ]
        clone.rest = copy.deepcopy(self.rest, memo)
        clone.chunks = copy.deepcopy(self.chunks, memo)
        clone.inner = copy.deepcopy(self.inner, memo)
        clone.host = HostWeights([p for unit in clone.units for p in unit.params], self.host.device)
        rest_bytes = device_weight_bytes(clone.rest)
        if clone.budget is not None and not clone.budget.make_room(rest_bytes, clone):
            raise RuntimeError(
                f"cannot copy {self.name!r}: its budget has no room for the {rest_bytes} bytes that stay on the device"
            )
        clone._start(rest_bytes)
        return clone

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

    def adopt_idle(self) -> None:
        """Take up host copies that user code replaced (`.double()`, `.to()`) for every parameter
        not in use now (the next forward does it anyway; reports call it to read true bytes)."""
        freed = sum(self.host.adopt(p) for p in self.host.params if self.counts.get(id(p), 0) == 0)
        self._charge(-freed)

    def acquire(self, unit: Unit, optional: bool = False) -> bool:
        """One more use of `unit`; the first brings its weights to the device (copying what is
        absent and not cached). False when `optional` and the budget has no room (a prefetch then
        waits for its turn); a RuntimeError naming the bytes when not optional."""
        if unit.refs == 0 and not self._bring(unit, optional):
            return False
        unit.refs += 1
        return True

    def _bring(self, unit: Unit, optional: bool) -> bool:
        was_cached, unit.cached = unit.cached, False  # never evicted while asked for
        absent = [p for p in unit.params if self.counts.get(id(p), 0) == 0]
        self._charge(-sum(self.host.adopt(p) for p in absent))
        fresh = [p for p in absent if not self.host.has_device_copy(p)]
        need = sum(nbytes_of(p) for p in fresh)
        if self.budget is not None and not self.budget.make_room(need, self):
            unit.cached = was_cached and any(self.host.has_device_copy(p) for p in unit.params)
            if optional:
                return False
            raise RuntimeError(
                f"ResidencyBudget of {self.budget.bytes} bytes is full ({self.budget.in_use} in use by "
                f"pieces running or held): {self.name}.{unit.name} needs {need} more bytes. Release "
                "holds/on_device blocks of other models first, or raise the budget"
            )
        for param in unit.params:
            self.counts[id(param)] = self.counts.get(id(param), 0) + 1
        event, allocated = self.host.bring(absent)
        if fresh:
            unit.event = event
            unit.copies += 1
            self.copies += 1
            self.bytes_moved += need
        self._charge(allocated)
        return True

    def release(self, unit: Unit) -> None:
        """One use of `unit` less; after the last its parameters read their host copies again (a
        budgeted swap model keeps the device copy cached, evictable)."""
        unit.refs -= 1
        if unit.refs > 0:
            return
        keep = self.budget is not None and self.mode == "swap"
        self.ready(unit)  # never free a storage a copy is still writing
        if keep:
            unit.cached = True
            assert self.budget is not None
            unit.last_used = self.budget.tick()
        freed = 0
        for param in unit.params:
            self.counts[id(param)] -= 1
            if self.counts[id(param)] == 0:
                freed += self.host.put_back(param, keep)
        self._charge(-freed)

    def evict(self, unit: Unit) -> None:
        """Free the cached device copies of an idle unit (a budget making room)."""
        unit.cached = False
        freed = sum(self.host.drop(p) for p in unit.params if self.counts.get(id(p), 0) == 0)
        self._charge(-freed)

    def ready(self, unit: Unit) -> None:
        if unit.event is not None:
            self.host.wait(unit.event)
            unit.event = None

    # ------------------------------------------------------------------ scopes and hooks

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
            inner = self.inner[ci]
            object.__setattr__(inner, ATTR, self)
            object.__setattr__(inner, "forward", _ScopedForward(self, ci, inner, inner.__dict__.get("forward")))
            if self.mode == "stream":
                for k, unit in enumerate(self.chunk_units[ci]):
                    for j, module in enumerate(unit.modules):
                        module.register_forward_pre_hook(functools.partial(self._enter, ci, k, j), with_kwargs=True)
                    unit.modules[-1].register_forward_hook(functools.partial(self._leave, ci, k))

    def _scope(self) -> _Scope:
        return self.scopes[-1] if self.scopes else self.loose

    def _refuse_grad(self, args: Any, kwargs: Any) -> None:
        """A backward would read weights this forward sends back to host: refuse before anything moves."""
        if torch.is_grad_enabled() and any(t.requires_grad for t in _input_tensors(args, kwargs)):
            raise ValueError(
                f"an input to {self.name!r} requires grad, but residency={self.mode!r} sends its weights back "
                "to host memory when the forward returns, so a backward could not read them. Run the forward "
                "under torch.no_grad() (or detach the input); or keep the weights on the device for the "
                "forward and the backward: `with hold(chunk):` (on_device(chunks) for swap) around both; or "
                "build it with residency='resident'"
            )

    def run_chunk(self, ci: int, forward: Any, args: Any, kwargs: Any) -> Any:
        """A chunk's forward in its own scope; the scope's units are released however it ends."""
        units = self.chunk_units[ci]
        if any(unit.holds == 0 for unit in units):
            self._refuse_grad(args, kwargs)
        scope = _Scope()
        self.scopes.append(scope)
        try:
            if self.mode == "swap":
                self.acquire(units[0])
                scope.running.append(units[0])
                self.ready(units[0])
            return forward(*args, **kwargs)
        finally:
            self.scopes.remove(scope)
            self._close(scope)

    def _close(self, scope: _Scope) -> None:
        units, scope.running, scope.prefetched = scope.running + scope.prefetched, [], []
        scope.pending.clear()
        for unit in reversed(units):
            self.release(unit)

    def _enter(self, ci: int, k: int, j: int, module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        units = self.chunk_units[ci]
        unit = units[k]
        scope = self._scope()
        if j > 0 and unit in scope.pending:
            return  # the head's output layer: its final norm brought it in
        if unit.holds == 0:
            self._refuse_grad(args, kwargs)
        if unit in scope.prefetched:
            scope.prefetched.remove(unit)  # the prefetch's use becomes this run's
        else:
            self.acquire(unit)
        scope.running.append(unit)
        if j < len(unit.modules) - 1:
            scope.pending.add(unit)
        if unit.holds == 0:
            for ahead in units[k + 1 : k + 1 + self.prefetch]:
                if ahead not in scope.prefetched and ahead not in scope.running and self.acquire(ahead, optional=True):
                    scope.prefetched.append(ahead)
        if self.budget is not None:
            unit.last_used = self.budget.tick()
        self.ready(unit)

    def _leave(self, ci: int, k: int, module: torch.nn.Module, args: Any, output: Any) -> None:
        unit = self.chunk_units[ci][k]
        scope = self._scope()
        if unit in scope.running:
            del scope.running[len(scope.running) - 1 - scope.running[::-1].index(unit)]
            scope.pending.discard(unit)
            self.release(unit)

    def release_streamed(self) -> None:
        """Release what layers run outside a chunk forward brought in (prefetches included)."""
        self._close(self.loose)

    def hold(self, units: list[Unit]) -> None:
        """Hold all of `units`, or none of them when one cannot come in."""
        done: list[Unit] = []
        try:
            for unit in units:
                self.acquire(unit)
                unit.holds += 1
                done.append(unit)
        except BaseException:
            self.unhold(done)
            raise

    def try_hold(self, units: list[Unit]) -> bool:
        """`hold` when the budget has room for all of `units` now; False (nothing held) otherwise."""
        done: list[Unit] = []
        for unit in units:
            if not self.acquire(unit, optional=True):
                for held in reversed(done):
                    self.release(held)
                return False
            done.append(unit)
        for unit in units:
            unit.holds += 1
        return True

    def unhold(self, units: list[Unit]) -> None:
        for unit in units:
            unit.holds -= 1
            self.release(unit)


def residency_of(chunks: Any) -> Residency | None:
    """The Residency of a build (its chunks, one chunk, or a module inside it), None for a resident one."""
    for chunk in as_chunks(chunks):
        found = getattr(chunk, ATTR, None)
        if isinstance(found, Residency):
            return found
    return None


def forward_device(chunks: Any) -> torch.device:
    """The device a build's forwards run on: a swap/stream build's (between forwards its
    parameters read their host copies), else the first parameter's (a resident build's)."""
    owner = residency_of(chunks)
    if owner is not None:
        return owner.host.device
    return next(p for chunk in as_chunks(chunks) for p in chunk.parameters()).device


def attach_residency(chunks: Sequence[torch.nn.Module], residency: str, *, prefetch: int = 1,
                     budget: ResidencyBudget | None = None, device: torch.device | None = None,
                     name: str = "model") -> list[torch.nn.Module]:
    """Move the weights of frozen `chunks` to host memory under `residency` ("swap" or "stream";
    "resident" leaves them as they are); returns the chunks."""
    mode = check_residency_args(residency, prefetch, budget)
    return attach_checked(chunks, mode, prefetch, budget, device, name)


def attach_checked(chunks: Sequence[torch.nn.Module], mode: str, prefetch: int, budget: ResidencyBudget | None,
                   device: torch.device | None, name: str) -> list[torch.nn.Module]:
    """attach_residency with arguments check_residency_args has passed (a build checks them once)."""
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
    inside: one host-to-device copy for the whole block, however many forwards run in it (their
    hooks only count their use, and prefetch nothing). Nested holds are counted. A no-op for a
    resident model."""
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


def hold_if_room(module: torch.nn.Module) -> Callable[[], None] | None:
    """A prefetch for a scheduler: hold `module`'s weights if its budget has room for them now and
    return the callable that ends the hold; None (nothing held) when it has not. A resident
    model: a no-op hold."""
    found = _covering(module)
    if found is None:
        return lambda: None
    owner, units = found
    if not owner.try_hold(units):
        return None
    return functools.partial(owner.unhold, units)


@contextlib.contextmanager
def weights_on_host(chunks: Any) -> Iterator[None]:
    """Inside: nothing of a swap/stream build is on the device, not even cached, so a loader's
    writes into the parameters (their host copies, as between any two forwards) are what the next
    forward reads; a resident build: a no-op. Refused while a hold, on_device block or forward is
    under way."""
    owner = residency_of(module_list(chunks, "chunks"))
    if owner is None:
        yield
        return
    busy = [unit.name for unit in owner.units if unit.active]
    if busy:
        raise RuntimeError(
            f"cannot load weights into {owner.name!r} while {', '.join(busy)} are on the device (a hold(), "
            "on_device() or forward is under way): load before or after it"
        )
    for unit in owner.units:
        owner.evict(unit)
    owner.adopt_idle()
    try:
        yield
    finally:
        owner.adopt_idle()


def release_streamed(chunks: Any) -> None:
    """Send back to host every weight that layers run outside a chunk's forward brought in (for
    callers that run its layers themselves; a chunk's own forward releases on return)."""
    owner = residency_of(module_list(chunks, "chunks"))
    if owner is not None:
        owner.release_streamed()


def note_activation_bytes(chunks: Any, nbytes: int) -> None:
    """Record the activation bytes a layer-major scorer keeps on the device now (for the report)."""
    owner = residency_of(chunks)
    if owner is not None:
        owner.activation_bytes = int(nbytes)
        owner.peak_activation_bytes = max(owner.peak_activation_bytes, int(nbytes))
