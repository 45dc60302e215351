"""The weight files of a Hugging Face checkpoint directory: safetensors only (no pickle is ever
read), checked against their index before anything is loaded; tensors read one at a time from
the files' own headers (the format is 8 bytes of header length, a JSON header, raw data)."""
from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_rl_patches.inference.loading.errors import shown

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
PICKLED = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")
_MAX_HEADER = 100 << 20  # a header beyond 100 MiB is not a safetensors file
ITEMSIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
              "U16": 2, "U32": 4, "U64": 8, "F8_E4M3": 1, "F8_E5M2": 1}


@dataclass(frozen=True)
class TensorEntry:
    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offsets in the file
    stop: int


def _header(file: Path) -> dict[str, TensorEntry]:
    try:
        with file.open("rb") as handle:
            raw = handle.read(8)
            if len(raw) != 8:
                raise ValueError("shorter than a safetensors header")
            (length,) = struct.unpack("<Q", raw)
            if length > _MAX_HEADER:
                raise ValueError(f"header length {length} is not plausible")
            header = json.loads(handle.read(length))
        size = file.stat().st_size
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"{str(file)!r} is not a readable safetensors file ({type(exc).__name__}: {exc}); "
                         "check that the download is complete") from None
    if not isinstance(header, dict):
        raise ValueError(f"{str(file)!r}: the safetensors header is a JSON {type(header).__name__}, not an object "
                         "of tensor entries; the file is damaged or not a safetensors file")
    entries = {name: _entry(file, name, meta, 8 + length, size)
               for name, meta in header.items() if name != "__metadata__"}
    _refuse_overlaps(file, entries)
    return entries


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _entry(file: Path, name: str, meta: Any, data_start: int, size: int) -> TensorEntry:
    """One header entry, its fields checked as the safetensors library checks them: offsets
    0 <= begin <= end within the data, and end - begin the bytes its shape and dtype take."""
    where = f"{str(file)!r}: tensor {name!r}"
    if not isinstance(meta, dict):
        raise ValueError(f"{where} has a header entry that is a {type(meta).__name__}, not an object "
                         "with dtype, shape and data_offsets; the file is damaged")
    dtype, shape, offsets = meta.get("dtype"), meta.get("shape"), meta.get("data_offsets")
    if not isinstance(dtype, str):
        raise ValueError(f"{where}: header field dtype must be a string, got {dtype!r}; the file is damaged")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise ValueError(f"{where}: header field shape must be a list of non-negative ints, got {shape!r}; "
                         "the file is damaged")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(x) for x in offsets)):
        raise ValueError(f"{where}: header field data_offsets must be two ints [begin, end], got {offsets!r}; "
                         "the file is damaged")
    begin, end = offsets
    if not 0 <= begin <= end:
        raise ValueError(f"{where}: header field data_offsets {offsets} must satisfy 0 <= begin <= end; "
                         "the file is damaged")
    itemsize = ITEMSIZES.get(dtype)
    numel = math.prod(shape)
    if itemsize is not None and end - begin != numel * itemsize:
        raise ValueError(f"{where}: header field data_offsets {offsets} span {end - begin} bytes but shape "
                         f"{shape} of {dtype} takes {numel * itemsize}; the file is damaged")
    start, stop = data_start + begin, data_start + end
    if stop > size:
        raise ValueError(f"{str(file)!r} is truncated ({name} ends at byte {stop}, the file has {size}); "
                         "download it again")
    return TensorEntry(file, dtype, tuple(shape), start, stop)


def _refuse_overlaps(file: Path, entries: dict[str, TensorEntry]) -> None:
    """Two tensors sharing bytes would give one the other's values."""
    ordered = sorted(entries.items(), key=lambda item: (item[1].start, item[1].stop))
    for (first, a), (second, b) in zip(ordered, ordered[1:]):
        if b.start < a.stop:
            raise ValueError(f"{str(file)!r}: the data_offsets of tensors {first!r} and {second!r} overlap; "
                             "the file is damaged")


def _weight_map(index_file: Path) -> dict[str, str]:
    """The index's tensor name -> file name map, its structure checked."""
    try:
        data = json.loads(index_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{str(index_file)!r} is not a readable safetensors index ({type(exc).__name__}: {exc})") \
            from None
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
    listed = sorted(set(_weight_map(index_file).values()))
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


_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn",  # block-scaled FP8 weights (fp8.py dequantizes them)
}


def read_tensor(entry: TensorEntry) -> Any:
    """One tensor (a new CPU torch tensor of the file's dtype)."""
    import torch

    name = _DTYPES.get(entry.dtype)
    if name is None:
        raise ValueError(f"{str(entry.file)!r}: dtype {entry.dtype} is not supported (quantized checkpoints are "
                         "not served; use a bf16/fp16/fp32 checkpoint)")
    with entry.file.open("rb") as handle:
        handle.seek(entry.start)
        data = bytearray(handle.read(entry.stop - entry.start))
    dtype = getattr(torch, name)
    if not data:
        return torch.empty(entry.shape, dtype=dtype)
    return torch.frombuffer(data, dtype=dtype).reshape(entry.shape)
