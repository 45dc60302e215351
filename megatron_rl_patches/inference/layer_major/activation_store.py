"""Hidden states kept between layers by layer-major scoring, one slot per micro-batch: on their
device while the bytes kept there stay within a budget, in host memory (pinned when CUDA is
present) beyond it, brought back to the device just before the micro-batch's next layer."""
from __future__ import annotations

import numbers
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class ActivationStats:
    """What the hidden states between layers cost: device bytes (peak), host bytes (peak) and the
    bytes moved device->host and back; `budget` is the device budget (None: unlimited)."""

    budget: int | None = None
    device_bytes_peak: int = 0
    host_bytes_peak: int = 0
    bytes_to_host: int = 0
    bytes_to_device: int = 0


def check_budget(activation_budget: object) -> int | None:
    """`activation_budget` as bytes (an int >= 0) or None; ValueError otherwise."""
    if activation_budget is None:
        return None
    if isinstance(activation_budget, numbers.Integral) and not isinstance(activation_budget, bool):
        budget = int(activation_budget)
        if budget >= 0:
            return budget
    raise ValueError(
        f"activation_budget must be None (keep every micro-batch's hidden states on the device) or "
        f"an int >= 0 of device bytes (beyond it they wait in host memory), got {activation_budget!r}"
    )


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class ActivationStore:
    """Slots of hidden states by micro-batch index; `put` keeps a tensor on its device if it fits
    the budget, else copies it to host memory; `take` returns it on its device and frees the slot."""

    def __init__(self, budget: int | None, on_change: Callable[[int], None] | None = None) -> None:
        self.stats = ActivationStats(budget=budget)
        self._slots: dict[int, tuple[torch.Tensor, torch.device, bool]] = {}
        self._device_bytes = 0
        self._host_bytes = 0
        self._on_change = on_change  # told the device bytes after every change

    def _device_change(self, nbytes: int) -> None:
        self._device_bytes += nbytes
        self.stats.device_bytes_peak = max(self.stats.device_bytes_peak, self._device_bytes)
        if self._on_change is not None:
            self._on_change(self._device_bytes)

    def put(self, index: int, tensor: torch.Tensor) -> None:
        if index in self._slots:
            raise KeyError(f"micro-batch {index} already has hidden states stored")
        size = _nbytes(tensor)
        budget = self.stats.budget
        if budget is None or self._device_bytes + size <= budget:
            self._slots[index] = (tensor, tensor.device, True)
            self._device_change(size)
            return
        # a real copy even when the device is the CPU, so the spill path is the same everywhere;
        # non_blocking: the copy back is queued on the same stream, after this one
        # empty_like keeps the strides: the layer sees the same layout, so the same kernels run
        host = torch.empty_like(tensor, device="cpu", pin_memory=tensor.is_cuda)
        host.copy_(tensor, non_blocking=tensor.is_cuda)
        self._slots[index] = (host, tensor.device, False)
        self._host_bytes += size
        self.stats.bytes_to_host += size
        self.stats.host_bytes_peak = max(self.stats.host_bytes_peak, self._host_bytes)

    def take(self, index: int) -> torch.Tensor:
        tensor, device, on_device = self._slots.pop(index)
        size = _nbytes(tensor)
        if on_device:
            self._device_change(-size)
            return tensor
        self._host_bytes -= size
        self.stats.bytes_to_device += size
        return tensor.to(device, non_blocking=tensor.is_pinned())

    def clear(self) -> None:
        """Drop every slot (after the last stage, or on an error)."""
        self._slots.clear()
        self._host_bytes = 0
        self._device_change(-self._device_bytes)

    def __len__(self) -> int:
        return len(self._slots)
