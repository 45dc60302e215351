"""Which bytes of a checkpoint's safetensors files torch reads inside a block (`FileReads`): every
torch call given a tensor that lies in a memory map of those files, and that does not merely view
it, reads that tensor's elements. For the tests of per-rank shard reads (Linux: /proc/self/maps)."""
from __future__ import annotations

import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

from megatron_rl_patches.inference.loading.json_read import parsed_json

# calls that look at a tensor's metadata, not its data (attribute reads come as `__get__`)
_METADATA = frozenset({"__get__", "__hash__", "__len__", "size", "stride", "dim", "numel", "nelement", "data_ptr",
                       "storage_offset", "untyped_storage", "is_contiguous", "element_size", "get_device",
                       "is_floating_point", "is_complex"})


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def _layout(file: Path) -> tuple[int, list[tuple[int, int, str]]]:
    """Where a safetensors file's data starts and each tensor's (begin, end, name) within it."""
    with open(file, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = parsed_json(handle.read(length), lambda problem: ValueError(f"{str(file)!r}'s header {problem}"))
    spans = sorted((*entry["data_offsets"], name) for name, entry in header.items() if name != "__metadata__")
    return 8 + length, spans


class FileReads(TorchFunctionMode):
    """Inside `with FileReads(root) as reads:`, the bytes of each tensor of the checkpoint at `root`
    that torch calls read from its memory maps; `fractions()` gives name -> share of its bytes."""

    def __init__(self, root: str | Path):
        super().__init__()
        self.files = {os.path.realpath(file): _layout(file) for file in Path(root).glob("*.safetensors")}
        self.read: dict[str, np.ndarray] = {}  # name -> a flag per byte

    def fractions(self) -> dict[str, float]:
        return {name: float(flags.mean()) if flags.size else 1.0 for name, flags in self.read.items()}

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if getattr(func, "__name__", "") in _METADATA:
            return out
        # memory maps are storages torch cannot resize: only those are looked up in the maps
        inputs = [t for t in _tensors((args, kwargs))
                  if t.numel() and t.device.type == "cpu" and not t.untyped_storage().resizable()]
        if inputs:
            maps = self._maps()
            views = {t.untyped_storage().data_ptr() for t in _tensors(out)}
            for tensor in inputs:
                if maps and tensor.untyped_storage().data_ptr() not in views:
                    self._mark(tensor, maps)
        return out

    def _maps(self) -> list[tuple[int, int, int, str]]:
        """(start, end, file offset, file) of this process's mappings of the checkpoint's files."""
        maps = []
        with open("/proc/self/maps") as handle:
            for line in handle:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].rstrip("\n") in self.files:
                    start, end = (int(x, 16) for x in fields[0].split("-"))
                    maps.append((start, end, int(fields[2], 16), fields[5].rstrip("\n")))
        return maps

    def _mark(self, tensor: torch.Tensor, maps: list[tuple[int, int, int, str]]) -> None:
        """Flag the bytes of `tensor` that lie in the checkpoint's files (numpy: no torch call for
        the modes to see)."""
        offsets: Any = np.zeros((), dtype=np.int64)
        for size, stride in zip(tensor.shape, tensor.stride()):
            offsets = (offsets[..., None] + np.arange(size, dtype=np.int64) * stride).ravel()
        item = tensor.element_size()
        addresses = ((tensor.data_ptr() + offsets * item)[:, None] + np.arange(item)).ravel()
        for start, end, file_offset, file in maps:
            at = addresses[(addresses >= start) & (addresses < end)] - start + file_offset
            data_start, spans = self.files[file]
            at = at[at >= data_start] - data_start  # the header is no tensor's
            which = np.searchsorted([span[0] for span in spans], at, side="right") - 1
            for index in np.unique(which).tolist():
                begin, stop, name = spans[index]
                mine = at[(which == index) & (at < stop)]
                flags = self.read.setdefault(name, np.zeros(stop - begin, dtype=bool))
                flags[mine - begin] = True
