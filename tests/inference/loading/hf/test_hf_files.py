"""The safetensors reader (the `safetensors` library under the package's own checks) against
damaged or hostile files: offsets outside the data, sharing bytes or leaving gaps, headers and
shard indexes of the wrong structure, and index entries naming files outside the checkpoint
directory — each refused as a ValueError naming the file and what the library found; symlinked
shards inside the directory (the Hugging Face cache's layout) still read; without the library, an
ImportError names the extra. No model is built."""
from __future__ import annotations

import json
import struct
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from megatron_rl_patches.inference.loading.hf.files import INDEX, TensorReader, read_tensor, tensor_index
from megatron_rl_patches.testing.hf_checkpoints import tiny_hf_config, write_safetensors, write_tiny_checkpoint


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
    ([-48, -40], [2], r"integer `-48`, expected usize"),
    ([8, 0], [2], r"invalid offset for tensor `w`"),
    ([0, 12], [2], r"invalid shape, data type, or offset for tensor"),
    ([0, 4], [2, 2], r"invalid shape, data type, or offset for tensor"),
])
def test_offsets_outside_the_data_or_of_another_size(tmp_path, offsets, shape, match):
    """A negative begin read the JSON header's bytes as weights (values ~1e17, no error)."""
    _raw(tmp_path / "model.safetensors", _f32("w", *offsets, shape), bytes(16))
    with pytest.raises(ValueError, match=r"model.safetensors' is not a readable safetensors file .*" + match):
        tensor_index(tmp_path)


def test_overlapping_tensors(tmp_path):
    """Two tensors on the same bytes: one would carry the other's values."""
    header = {**_f32("first", 0, 8, [2]), **_f32("second", 4, 12, [2])}
    _raw(tmp_path / "model.safetensors", header, bytes(12))
    with pytest.raises(ValueError, match=r"invalid offset for tensor `second`"):
        tensor_index(tmp_path)
    _raw(tmp_path / "model.safetensors", {**_f32("first", 0, 8, [2]), **_f32("second", 12, 20, [2])}, bytes(20))
    with pytest.raises(ValueError, match=r"invalid offset for tensor `second`"):  # a gap: bytes no tensor owns
        tensor_index(tmp_path)
    _raw(tmp_path / "model.safetensors", {**_f32("first", 0, 8, [2]), **_f32("second", 8, 16, [2])}, bytes(16))
    assert set(tensor_index(tmp_path)) == {"first", "second"}  # adjacent ranges are fine


@pytest.mark.parametrize(("header", "match"), [
    ([], r"invalid type: sequence"),
    ({"w": [1, 2]}, r"invalid type: sequence, expected struct TensorInfo|expected string or map"),
    ({"w": {"dtype": "F32", "shape": [1]}}, r"missing field `data_offsets`"),
    ({"w": {"dtype": "F32", "shape": [1], "data_offsets": ["a", 4]}}, r"invalid type: string \"a\", expected usize"),
    ({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, True]}}, r"invalid type: boolean `true`, expected usize"),
    ({"w": {"dtype": "F32", "shape": "1", "data_offsets": [0, 4]}}, r"invalid type: string \"1\", expected a sequence"),
    ({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, r"invalid value: integer `-1`, expected usize"),
    ({"w": {"dtype": 3, "shape": [1], "data_offsets": [0, 4]}}, r"invalid type: integer `3`"),
    ({"w": {"dtype": "F99", "shape": [1], "data_offsets": [0, 4]}}, r"unknown variant `F99`"),
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


def test_a_dtype_the_build_does_not_serve_is_named_on_reading(tmp_path):
    """The library knows F8_E8M0; the build serves floats, ints and block FP8 only."""
    _raw(tmp_path / "model.safetensors", {"w": {"dtype": "F8_E8M0", "shape": [4], "data_offsets": [0, 4]}}, bytes(4))
    entry = tensor_index(tmp_path)["w"]
    assert (entry.dtype, entry.shape) == ("F8_E8M0", (4,))
    with pytest.raises(ValueError, match=r"tensor 'w' has dtype F8_E8M0, which is not served"):
        read_tensor(entry)


def test_without_the_library_an_import_error_names_the_extra(tmp_path, monkeypatch):
    """Reading needs the library; planning memory from config.json does not."""
    from megatron_rl_patches.inference.loading.hf.memory_plan import hf_memory_plan

    write_tiny_checkpoint(tmp_path, tiny_hf_config("qwen3"))
    monkeypatch.setitem(sys.modules, "safetensors", None)
    hint = r"pip install safetensors, or the wheel built from a clone with the extra \[hf\]"
    with pytest.raises(ImportError, match=hint):
        tensor_index(tmp_path)
    assert hf_memory_plan(tmp_path).total_params > 0
    monkeypatch.undo()
    assert "model.embed_tokens.weight" in tensor_index(tmp_path)  # negative control


def test_reading_maps_about_one_tensor_at_a_time(tmp_path):
    """The reader re-opens a file once the views taken through it reach its budget (the largest
    tensor by default), so the pages mapped at once stay within about one tensor."""
    tensors = {f"t{i}": torch.full((256,), float(i)) for i in range(6)}
    write_safetensors(tmp_path / "model.safetensors", tensors)
    index = tensor_index(tmp_path)
    reader = TensorReader(index)
    assert reader.budget == 1024

    def gaps(reader: TensorReader) -> set[int]:  # views alive together: one map puts them 1024 bytes apart
        views = [reader.view(name) for name in tensors]
        assert all(torch.equal(view, tensors[name]) for view, name in zip(views, tensors))
        return {b.data_ptr() - a.data_ptr() for a, b in zip(views, views[1:])}

    assert gaps(reader) != {1024}  # a map per tensor at this budget
    assert gaps(TensorReader(index, budget=10 * 1024)) == {1024}  # one map for all (negative control)


@pytest.mark.parametrize("name", ["./model-1.safetensors", "sub/../model-1.safetensors", ".//model-1.safetensors"])
def test_index_names_are_normalized_inside_the_directory(tmp_path, name):
    """"./model-1.safetensors" names the file beside the index: it was refused as unlisted; the
    cache's symlink to ../../blobs/ made by the directory's owner is still followed."""
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    write_safetensors(blobs / "abc123", {"w": torch.full((2,), 3.0), "v": torch.full((1,), 2.0)})
    snapshot = tmp_path / "snapshots" / "rev"
    snapshot.mkdir(parents=True)
    (snapshot / "model-1.safetensors").symlink_to("../../blobs/abc123")
    weight_map = {"w": name, "v": "model-1.safetensors"}
    (snapshot / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    index = tensor_index(snapshot)
    assert torch.equal(read_tensor(index["w"]), torch.full((2,), 3.0)) and set(index) == {"w", "v"}
    (snapshot / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": {"w": "./../rev/model-1.safetensors"}}))
    with pytest.raises(ValueError, match=r"outside the checkpoint directory"):
        tensor_index(snapshot)
