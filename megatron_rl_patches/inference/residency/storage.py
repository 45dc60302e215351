"""Weights that live in host memory. Between uses a Parameter's `.data` IS its host copy (pinned
with CUDA), so everything user code does with the model (reductions, numpy, state_dict,
torch.save, deepcopy, load_state_dict) reads and writes the real weights. While a piece runs,
`.data` is a device copy made from the host copy, and it goes back to the host copy on release
(or, for a budgeted swap model, the device copy is kept aside, cached, until evicted or stale).

On CUDA the copies run on a side stream and the compute stream waits on an event. On CPU the
"device" is host memory too: a device copy is a separate storage, and `device_weight_bytes`
counts the device copies only (never the host copies), so the CPU tests measure what CUDA holds."""
from __future__ import annotations

import warnings
import weakref
from collections.abc import Iterable
from typing import Any

import torch

from megatron_rl_patches._log import logger

_ENGINES: weakref.WeakSet[HostWeights] = weakref.WeakSet()


def nbytes_of(param: torch.Tensor) -> int:
    return param.numel() * param.element_size()


def _device_tensor(param: torch.Tensor) -> torch.Tensor | None:
    """What `param` holds on the device: its device copy when residency manages it (None when it
    is only in host memory), else the parameter itself."""
    for engine in list(_ENGINES):
        slot = engine.slots.get(id(param))
        if slot is not None and slot.param is param:
            return slot.device
    return param


def device_weight_bytes(params: Iterable[torch.Tensor]) -> int:
    """Device bytes of `params`: the (unique) storages of unmanaged parameters, and the device
    copies (in use or cached) of parameters whose weights residency keeps in host memory; host
    copies are never counted. The device-byte counter the tests and residency_report read."""
    seen: set[int] = set()
    total = 0
    for param in params:
        tensor = _device_tensor(param)
        if tensor is None:
            continue
        storage = tensor.untyped_storage()
        key = storage.data_ptr() if storage.nbytes() else id(param)
        if key not in seen:
            seen.add(key)
            total += int(storage.nbytes())
    return total


def pin_host_copy(host: torch.Tensor, nbytes_total: list[int]) -> torch.Tensor:
    """Pinned copy of `host` when CUDA is present; pageable with one warning if pinning fails."""
    try:
        return host.pin_memory()
    except RuntimeError as exc:
        if nbytes_total[0] >= 0:  # warn once per build
            warnings.warn(
                f"megatron-rl-patches: pinning {nbytes_total[0]} bytes of host weights failed ({exc}); "
                "keeping them in pageable memory (host-to-device copies will be slower and not overlap). "
                "Raise the locked-memory limit (ulimit -l) or free host memory to get pinned copies",
                RuntimeWarning,
                stacklevel=4,
            )
            nbytes_total[0] = -1
        return host


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() and a.dtype == b.dtype


class _Slot:
    """One managed Parameter: its host copy, and its device copy while in use or cached (with
    the parameter's version when cached, so an in-place write in between makes it stale)."""

    __slots__ = ("param", "host", "device", "version")

    def __init__(self, param: torch.nn.Parameter, host: torch.Tensor):
        self.param = param
        self.host = host
        self.device: torch.Tensor | None = None
        self.version = -1


class HostWeights:
    """The host copies of a model's parameters (one per Parameter object, so tied weights share
    one) and the copy engine that makes and drops their device copies."""

    def __init__(self, params: list[torch.nn.Parameter], device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.slots: dict[int, _Slot] = {}
        self.pinned = self.cuda
        self._pin_total = [sum(nbytes_of(p) for p in params)]
        for param in params:
            if id(param) not in self.slots:
                self.slots[id(param)] = _Slot(param, self._home(param))
        self.side_stream = torch.cuda.Stream(device=device) if self.cuda else None
        _ENGINES.add(self)

    def _home(self, param: torch.nn.Parameter) -> torch.Tensor:
        """Make `param.data` a host tensor (pinned with CUDA) and return it."""
        host = param.data
        if host.device.type != "cpu":
            host = host.to("cpu")
        if self.cuda and not host.is_pinned():
            host = pin_host_copy(host, self._pin_total)
            self.pinned = self.pinned and host.is_pinned()
        if host is not param.data:
            param.data = host
        return host

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return [slot.param for slot in self.slots.values()]

    @property
    def nbytes(self) -> int:
        return sum(nbytes_of(slot.host) for slot in self.slots.values())

    def adopt(self, param: torch.nn.Parameter) -> int:
        """For a parameter not in use: when user code replaced its `.data` (`.double()`, `.to()`,
        `p.data = ...`), that is the new host copy; a cached device copy made from the old one or
        from a value written in place since is dropped. Returns the device bytes freed."""
        slot = self.slots[id(param)]
        if not _same_storage(param.data, slot.host) or param.data.shape != slot.host.shape:
            slot.host = self._home(param)
            return self.drop(param)
        if slot.device is not None and slot.version != param._version:
            return self.drop(param)
        return 0

    def has_device_copy(self, param: torch.nn.Parameter) -> bool:
        return self.slots[id(param)].device is not None

    def bring(self, params: list[torch.nn.Parameter]) -> tuple[Any, int]:
        """Point `params` at their device copies, copying from host what has none (cached ones are
        reused); returns (a CUDA event to wait on or None, device bytes allocated)."""
        fresh = [self.slots[id(p)] for p in params if self.slots[id(p)].device is None]
        for slot in fresh:  # allocated on the compute stream, so frees there are ordered with its kernels
            slot.device = torch.empty(slot.host.shape, dtype=slot.host.dtype, device=self.device)
        event = None
        if fresh and not self.cuda:
            for slot in fresh:
                assert slot.device is not None
                slot.device.copy_(slot.host)
        elif fresh:
            current = torch.cuda.current_stream(self.device)
            assert self.side_stream is not None
            self.side_stream.wait_stream(current)
            with torch.cuda.stream(self.side_stream):
                for slot in fresh:
                    assert slot.device is not None
                    slot.device.copy_(slot.host, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self.side_stream)
        for param in params:
            slot = self.slots[id(param)]
            param.data = slot.device  # type: ignore[assignment]
            slot.version = param._version
        return event, sum(nbytes_of(slot.host) for slot in fresh)

    def put_back(self, param: torch.nn.Parameter, keep: bool) -> int:
        """`param` reads its host copy again; its device copy is kept (cached) when `keep`, else
        freed. What user code did to the weight while it was on the device is kept: a replaced
        `.data` (`.double()` inside a hold) becomes the host copy, a write through the Parameter
        (`load_state_dict` inside a hold) is copied back. Returns the device bytes freed."""
        slot = self.slots[id(param)]
        if slot.device is None or not _same_storage(param.data, slot.device):
            freed = self.drop(param)
            slot.host = self._home(param)
            slot.version = param._version
            return freed
        if param._version != slot.version:
            slot.host.copy_(slot.device)
        param.data = slot.host
        slot.version = param._version
        return 0 if keep else self.drop(param)

    def drop(self, param: torch.nn.Parameter) -> int:
        """Free the cached device copy of a parameter not in use; returns the bytes freed."""
        slot = self.slots[id(param)]
        if slot.device is None:
            return 0
        freed = nbytes_of(slot.device)
        slot.device = None
        return freed

    def wait(self, event: Any) -> None:
        """Make the compute stream wait for a copy `bring` started."""
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def snapshot(self) -> dict[int, torch.Tensor]:
        """The host copies by parameter id (the tests compare them bit for bit)."""
        return {key: slot.host for key, slot in self.slots.items()}


def log_fallback(name: str, needed: int, budget: int) -> None:
    logger.warning(
        "megatron-rl-patches: model %s needs %d bytes on the device, more than its budget of %d bytes: "
        "streaming it layer by layer instead of swapping it whole",
        name,
        needed,
        budget,
    )
