"""The safetensors reader against damaged or hostile files: offsets outside the data or sharing
bytes, headers and shard indexes of the wrong structure, and index entries naming files outside
the checkpoint directory — each refused naming the file and the field; symlinked shards inside the
directory (the Hugging Face cache's layout) still read. No model is built."""
from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest
import torch

from megatron_rl_patches.inference.loading.hf.files import INDEX, read_tensor, tensor_index
from megatron_rl_patches.testing.hf_checkpoints import write_safetensors


def _raw(file: Path, header: Any, data: bytes = b"") -> None:
    """A safetensors file with exactly this header (any JSON) and data bytes."""
    raw = json.dumps(header).encode()
    file.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def _f32(name: str, begin: int, end: int, shape: list[int]) -> dict[str, Any]:
    return {name: {"dtype": "F32", "shape": shape, "data_offsets": [begin, end]}}


def test_a_well_formed_file_reads_back(tmp_path):
    """Negative control: the checks pass what a correct writer writes, empty tensors too."""
    tensors = {"a": torch.randn(3, 2), "c": torch.zeros(0, 4), "d": torch.randn(7)}
    write_safetensors(tmp_path / "model.safetensors", tensors)
    index = tensor_index(tmp_path)
    for name, tensor in tensors.items():
        assert torch.equal(read_tensor(index[name]), tensor)


@pytest.mark.parametrize(("offsets", "shape", "match"), [
    ([-48, -40], [2], r"'w': header field data_offsets \[-48, -40\] must satisfy 0 <= begin <= end"),
    ([8, 0], [2], r"data_offsets \[8, 0\] must satisfy 0 <= begin <= end"),
    ([0, 12], [2], r"data_offsets \[0, 12\] span 12 bytes but shape \[2\] of F32 takes 8"),
    ([0, 4], [2, 2], r"span 4 bytes but shape \[2, 2\] of F32 takes 16"),
])
def test_offsets_outside_the_data_or_of_another_size(tmp_path, offsets, shape, match):
    """A negative begin read the JSON header's bytes as weights (values ~1e17, no error)."""
    _raw(tmp_path / "model.safetensors", _f32("w", *offsets, shape), bytes(16))
    with pytest.raises(ValueError, match=match):
        tensor_index(tmp_path)


def test_overlapping_tensors(tmp_path):
    """Two tensors on the same bytes: one would carry the other's values."""
    header = {**_f32("first", 0, 8, [2]), **_f32("second", 4, 12, [2])}
    _raw(tmp_path / "model.safetensors", header, bytes(12))
    with pytest.raises(ValueError, match=r"tensors 'first' and 'second' overlap"):
        tensor_index(tmp_path)
    _raw(tmp_path / "model.safetensors", {**_f32("first", 0, 8, [2]), **_f32("second", 8, 16, [2])}, bytes(16))
    assert set(tensor_index(tmp_path)) == {"first", "second"}  # adjacent ranges are fine


@pytest.mark.parametrize(("header", "match"), [
    ([], r"the safetensors header is a JSON list, not an object"),
    ({"w": [1, 2]}, r"tensor 'w' has a header entry that is a list, not an object"),
    ({"w": {"dtype": "F32", "shape": [1]}}, r"'w': header field data_offsets must be two ints .* got None"),
    ({"w": {"dtype": "F32", "shape": [1], "data_offsets": ["a", 4]}}, r"data_offsets must be two ints"),
    ({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, True]}}, r"data_offsets must be two ints"),
    ({"w": {"dtype": "F32", "shape": "1", "data_offsets": [0, 4]}}, r"header field shape must be a list"),
    ({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, r"header field shape must be a list"),
    ({"w": {"dtype": 3, "shape": [1], "data_offsets": [0, 4]}}, r"header field dtype must be a string"),
])
def test_header_structure(tmp_path, header, match):
    _raw(tmp_path / "model.safetensors", header, bytes(4))
    with pytest.raises(ValueError, match=match) as caught:
        tensor_index(tmp_path)
    assert "model.safetensors" in str(caught.value)


def _sharded(root: Path, weight_map: Any) -> None:
    root.mkdir(exist_ok=True)
    write_safetensors(root / "model-1.safetensors", {"w": torch.ones(2)})
    (root / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.mark.parametrize(("weight_map", "match"), [
    ([], r"field weight_map must be an object .* got list"),
    (None, r"field weight_map must be an object .* got NoneType"),
    ({"w": 1}, r"field weight_map must map tensor names to file names \(strings\), got w: 1"),
])
def test_index_structure(tmp_path, weight_map, match):
    _sharded(tmp_path, weight_map)
    with pytest.raises(ValueError, match=match):
        tensor_index(tmp_path)
    (tmp_path / INDEX).write_text("[]")
    with pytest.raises(ValueError, match=r"field weight_map must be an object"):
        tensor_index(tmp_path)


def test_index_entries_outside_the_directory_are_refused(tmp_path):
    """A sibling directory's weights (by `..` or an absolute path) are never read."""
    other = tmp_path / "other"
    other.mkdir()
    write_safetensors(other / "model.safetensors", {"w": torch.full((2,), 7.0)})
    root = tmp_path / "teacher"
    for name in ("../other/model.safetensors", str(other / "model.safetensors"), "sub/../../other/model.safetensors"):
        _sharded(root, {"w": name})
        (root / "model-1.safetensors").unlink()
        with pytest.raises(ValueError, match=r"weight_map names file\(s\) outside the checkpoint directory"):
            tensor_index(root)


def test_symlinked_shards_inside_the_directory_still_read(tmp_path):
    """The Hugging Face cache links each snapshot file to a blob elsewhere: that is fine."""
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    write_safetensors(blobs / "abc123", {"w": torch.full((2,), 3.0)})
    snapshot = tmp_path / "snapshots" / "rev"
    snapshot.mkdir(parents=True)
    (snapshot / "model-1.safetensors").symlink_to(blobs / "abc123")
    (snapshot / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": {"w": "model-1.safetensors"}}))
    assert torch.equal(read_tensor(tensor_index(snapshot)["w"]), torch.full((2,), 3.0))
