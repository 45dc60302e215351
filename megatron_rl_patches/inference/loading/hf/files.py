"""The weight files of a Hugging Face checkpoint directory: safetensors only (no pickle is ever
read), checked against their index before anything is loaded; headers and tensors read through the
`safetensors` library (memory-mapped: a tensor is a view of the file's pages, read when touched)."""
from __future__ import annotations

import os
import posixpath
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Any

from megatron_rl_patches.inference.loading.errors import checkpoint_json, shown
from megatron_rl_patches.inference.loading.hf.extras import install_hint

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
PICKLED = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")
EXTRA = "hf"  # the extra bringing safetensors


ITEMSIZES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
             "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}  # bytes per element, by safetensors dtype


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of the checkpoint as its file's header describes it (nothing read yet); with
    `part`, rows [first, stop) of slab `index` of the file's 3-D tensor `name` (an expert of a
    stacked expert tensor), `shape` then being that part's."""

    file: Path
    name: str  # the tensor's name in the file
    dtype: str  # the safetensors name: F32, BF16, F8_E4M3...
    shape: tuple[int, ...]
    part: tuple[int, int, int] | None = None  # (index, first, stop)

    @property
    def nbytes(self) -> int:
        return prod(self.shape) * ITEMSIZES.get(self.dtype, 1)


def safe_open_of(file: Path) -> Any:
    """The library's memory-mapped reader of `file` (torch tensors); ValueError naming the file
    when the library refuses it (its header, offsets, dtypes and size are checked on opening)."""
    try:
        from safetensors import SafetensorError, safe_open  # lazy: optional dependency safetensors
    except ImportError:
        raise ImportError(f"reading Hugging Face checkpoints needs the safetensors library: "
                          f"{install_hint(EXTRA, 'safetensors')}") from None
    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except (SafetensorError, OSError) as exc:
        problem = str(exc)
        if "not fully covered" in problem:  # the data ends before or after the header's last tensor
            raise ValueError(f"{str(file)!r} is truncated or has trailing bytes (the safetensors library: "
                             f"{problem}); download it again") from None
        raise ValueError(f"{str(file)!r} is not a readable safetensors file (the safetensors library: {problem}); "
                         "the file is damaged or not a safetensors file: download it again") from None


def _header(file: Path) -> dict[str, TensorEntry]:
    """Every tensor of one file, its dtype and shape (the library has checked the offsets)."""
    handle = safe_open_of(file)
    entries = {}
    for name in handle.keys():
        view = handle.get_slice(name)
        entries[name] = TensorEntry(file, name, view.get_dtype(), tuple(view.get_shape()))
    return entries


def _weight_map(index_file: Path) -> dict[str, str]:
    """The index's tensor name -> file name map, its structure checked."""
    data = checkpoint_json(index_file)
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict):
        raise ValueError(f"{str(index_file)!r}: field weight_map must be an object of tensor name -> file name, "
                         f"got {type(weight_map).__name__}; download the index again")
    bad = [f"{name}: {value!r}" for name, value in weight_map.items() if not isinstance(value, str)]
    if bad:
        raise ValueError(f"{str(index_file)!r}: field weight_map must map tensor names to file names (strings), "
                         f"got {shown(bad)}; download the index again")
    return weight_map


def _inside(root: Path, index_file: Path, names: list[str]) -> None:
    """Refuse index entries naming a file outside the checkpoint directory (an absolute path or
    `..`): the build would read another checkpoint's weights. Judged on the names, so the Hugging
    Face cache's symlinked shards inside the directory stay fine."""
    outside = [name for name in names
               if os.path.isabs(name) or os.path.normpath(name).split(os.sep)[0] == os.pardir]
    if outside:
        raise ValueError(f"{str(index_file)!r}: field weight_map names file(s) outside the checkpoint directory: "
                         f"{shown(outside)}; every weight file must be inside {str(root)!r}")


def _listed_files(root: Path) -> list[Path]:
    """The safetensors files the checkpoint consists of, refusing missing and unlisted ones."""
    index_file = root / INDEX
    present = sorted(root.glob("*.safetensors"))
    if not index_file.is_file():
        if (root / SINGLE).is_file():
            others = [p.name for p in present if p.name != SINGLE]
            if others:
                raise ValueError(f"{str(root)!r} holds {SINGLE} and also {shown(others)} with no {INDEX}: "
                                 "remove the files that are not part of this checkpoint")
            return [root / SINGLE]
        pickled = sorted(p.name for pattern in PICKLED for p in root.glob(pattern))
        hint = (f" It holds {shown(pickled)}: pickle files are never read; convert them to safetensors "
                "(e.g. load with transformers and save_pretrained(..., safe_serialization=True))") if pickled else ""
        raise FileNotFoundError(f"{str(root)!r} has no {SINGLE} and no {INDEX}.{hint}")
    # names as paths inside the directory ("./w.safetensors" is w.safetensors), judged after normalizing
    listed = sorted({posixpath.normpath(name) for name in _weight_map(index_file).values()})
    _inside(root, index_file, listed)
    missing = [name for name in listed if not (root / name).is_file()]
    if missing:
        raise FileNotFoundError(f"{str(root)!r} lacks {len(missing)} weight file(s) its {INDEX} lists: "
                                f"{shown(missing)}; download them (the checkpoint is incomplete)")
    extra = [p.name for p in present if p.name not in set(listed)]
    if extra:
        raise ValueError(f"{str(root)!r} holds {len(extra)} safetensors file(s) its {INDEX} does not list: "
                         f"{shown(extra)}; remove them (they belong to another checkpoint or an older download)")
    return [root / name for name in listed]


def tensor_index(root: Path) -> dict[str, TensorEntry]:
    """Every tensor of the checkpoint by its Hugging Face name (each name in exactly one file)."""
    entries: dict[str, TensorEntry] = {}
    for file in _listed_files(root):
        for name, entry in _header(file).items():
            if name in entries:
                raise ValueError(f"{str(root)!r}: tensor {name} is in both {entries[name].file.name} and "
                                 f"{file.name}; remove the stale file")
            entries[name] = entry
    return entries


_SERVED = ("F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL",
           "F8_E4M3")  # block-scaled FP8 weights (fp8.py dequantizes them)


def _check_served(entry: TensorEntry) -> None:
    if entry.dtype not in _SERVED:
        raise ValueError(f"{str(entry.file)!r}: tensor {entry.name!r} has dtype {entry.dtype}, which is not served "
                         "(quantized checkpoints other than block FP8 are not; use a bf16/fp16/fp32 checkpoint)")


class TensorReader:
    """Zero-copy views of checkpoint tensors, one memory map per file re-opened whenever the views
    taken through it reach `budget` bytes: the file pages mapped at once (which count in the
    process's resident memory while mapped) stay within about one tensor."""

    def __init__(self, index: dict[str, TensorEntry], budget: int | None = None):
        self.index = index
        self.budget = budget if budget is not None else max((e.nbytes for e in index.values()), default=0)
        self._open: dict[Path, tuple[Any, int]] = {}

    def view(self, name: str) -> Any:
        """The tensor `name` as a view of its file's pages (do not keep it: it keeps them mapped)."""
        entry = self.index[name]
        _check_served(entry)
        handle, taken = self._open.get(entry.file, (None, 0))
        if handle is None or taken + entry.nbytes > self.budget:
            self._open.clear()  # the old maps go when their last view does
            handle, taken = safe_open_of(entry.file), 0
        self._open[entry.file] = (handle, taken + entry.nbytes)
        if entry.part is not None:  # only this part's bytes are read
            index, first, stop = entry.part
            return handle.get_slice(entry.name)[index, first:stop]
        return handle.get_tensor(entry.name)

    def close(self) -> None:
        self._open.clear()


@contextmanager
def tensor_reader(index: dict[str, TensorEntry]) -> Iterator[TensorReader]:
    """A TensorReader whose memory maps are released on leaving."""
    reader = TensorReader(index)
    try:
        yield reader
    finally:
        reader.close()


def read_tensor(entry: TensorEntry) -> Any:
    """One tensor (a new CPU torch tensor of the file's dtype, not backed by the file)."""
    return TensorReader({entry.name: entry}).view(entry.name).clone()
