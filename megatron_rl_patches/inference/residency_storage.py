"""Weights that live in host memory: one host copy per Parameter, and the device storage of the
Parameter released (resized to 0 bytes, the Parameter object kept, as FSDP does) and restored
from that copy. On CUDA copies run on a side stream and the compute stream waits on an event; on
CPU the "device" is host memory too, and a restore is a real copy into a fresh storage."""
from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

import torch

from megatron_rl_patches._log import logger


def storage_bytes(param: torch.Tensor) -> int:
    """Bytes the parameter's storage holds right now (0 once released)."""
    return int(param.untyped_storage().nbytes())


def device_weight_bytes(params: Iterable[torch.Tensor]) -> int:
    """Bytes the (unique) storages of `params` hold: the device-byte counter the tests read."""
    seen: set[int] = set()
    total = 0
    for param in params:
        storage = param.untyped_storage()
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


class HostWeights:
    """The host copies of a model's parameters (one per Parameter object, so tied weights share
    one), and the copy engine moving them to the parameters' device storage."""

    def __init__(self, params: list[torch.nn.Parameter], device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.host: dict[int, torch.Tensor] = {}
        self.params: dict[int, torch.nn.Parameter] = {}
        self.pinned = False
        total = [sum(p.numel() * p.element_size() for p in params)]
        for param in params:
            if id(param) in self.host:
                continue
            host = param.detach()
            if host.device.type != "cpu":
                host = host.to("cpu")
            # the host copy must never alias what the forward reads: on CPU the parameter's own
            # storage becomes the "device" storage, so keep a separate copy
            host = host.clone() if not self.cuda else host.contiguous()
            if self.cuda:
                host = pin_host_copy(host, total)
                self.pinned = total[0] >= 0
            self.host[id(param)] = host
            self.params[id(param)] = param
            self._own_storage(param)
            self.release(param)
        self.side_stream = torch.cuda.Stream(device=device) if self.cuda else None

    def _own_storage(self, param: torch.nn.Parameter) -> None:
        """Give `param` a contiguous storage of its own on the device (a view into a shared
        buffer cannot be resized alone)."""
        storage = param.untyped_storage()
        exact = param.is_contiguous() and param.storage_offset() == 0
        if param.device != self.device or not exact or storage.nbytes() != param.numel() * param.element_size():
            param.data = torch.empty(param.shape, dtype=param.dtype, device=self.device)

    @property
    def nbytes(self) -> int:
        return sum(h.numel() * h.element_size() for h in self.host.values())

    def release(self, param: torch.nn.Parameter) -> None:
        """Free the parameter's device storage; the Parameter object stays (shape and dtype too)."""
        param.untyped_storage().resize_(0)

    def restore(self, params: list[torch.nn.Parameter]) -> Any:
        """Copy the host copies into fresh device storages of `params`; returns a CUDA event to wait
        on (None on CPU, where the copy is done on return)."""
        if not params:
            return None
        for param in params:
            param.untyped_storage().resize_(param.numel() * param.element_size())
        if not self.cuda:
            for param in params:
                param.data.copy_(self.host[id(param)])
            return None
        # storages were allocated on the compute stream (so frees there are ordered with its
        # kernels); the side stream waits for what is already queued, then copies
        current = torch.cuda.current_stream(self.device)
        assert self.side_stream is not None
        self.side_stream.wait_stream(current)
        with torch.cuda.stream(self.side_stream):
            for param in params:
                param.data.copy_(self.host[id(param)], non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.side_stream)
        return event

    def wait(self, event: Any) -> None:
        """Make the compute stream wait for a copy `restore` started."""
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def snapshot(self) -> dict[int, torch.Tensor]:
        """The host copies by parameter id (the tests compare them bit for bit)."""
        return dict(self.host)


def log_fallback(name: str, needed: int, budget: int) -> None:
    logger.warning(
        "megatron-rl-patches: model %s needs %d bytes on the device, more than its budget of %d bytes: "
        "streaming it layer by layer instead of swapping it whole",
        name,
        needed,
        budget,
    )
