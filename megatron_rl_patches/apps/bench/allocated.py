"""Peak bytes the ops allocate on CPU while a block runs: a dispatch mode that counts each new
storage an op returns until the storage is freed (views share their base's; tensors made before
the block, e.g. the weights, are not counted). Exact for what torch's ops allocate, none of the
allocator's own slack; for comparing two routes of one computation on CPU (RSS cannot resolve
tens of MiB on a shared machine)."""
# lazy imports: import cost: torch loads when a benchmark runs
from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class AllocatedPeak(TorchDispatchMode):
    """`with AllocatedPeak() as seen: ...`; then `seen.peak` (bytes) and `seen.largest` (the
    largest one storage, bytes)."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.now = self.peak = self.largest = 0

    def freed(self, key: int) -> None:
        self.now -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for one in tree_leaves(out):
            if isinstance(one, torch.Tensor) and one.device.type == "cpu":
                storage = one.untyped_storage()
                key = storage.data_ptr()
                if key and key not in self.live:
                    self.live[key] = storage.nbytes()
                    self.now += storage.nbytes()
                    self.peak = max(self.peak, self.now)
                    self.largest = max(self.largest, storage.nbytes())
                    weakref.finalize(storage, self.freed, key)
        return out
