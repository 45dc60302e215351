"""The weight files of a Hugging Face checkpoint directory: safetensors only (no pickle is ever
read), checked against their index before anything is loaded; tensors read one at a time from
the files' own headers (the format is 8 bytes of header length, a JSON header, raw data)."""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_rl_patches.inference.loading.errors import shown

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
PICKLED = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")
_MAX_HEADER = 100 << 20  # a header beyond 100 MiB is not a safetensors file


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
    entries = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        start, stop = (8 + length + int(x) for x in meta["data_offsets"])
        if stop > size:
            raise ValueError(f"{str(file)!r} is truncated ({name} ends at byte {stop}, the file has {size}); "
                             "download it again")
        entries[name] = TensorEntry(file, str(meta["dtype"]), tuple(int(d) for d in meta["shape"]), start, stop)
    return entries


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
    try:
        weight_map = json.loads(index_file.read_text(encoding="utf-8"))["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{str(index_file)!r} is not a readable safetensors index ({type(exc).__name__}: {exc})") \
            from None
    listed = sorted(set(weight_map.values()))
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
