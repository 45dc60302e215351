"""Weights-only loading on real megatron-core (CPU): torch_dist checkpoints and Megatron-LM roots
through the default sharded load strategy (the common state is never unpickled), state-dict
files, and damaged checkpoints: clear errors, the model untouched (or said to be undefined)."""
from __future__ import annotations

import argparse
import logging
import re
import shutil

import pytest
import torch

from megatron_rl_patches.testing.multirank import run_multirank

pytestmark = pytest.mark.megatron

UNPICKLED: list[str] = []


def _tripwire_unpickled() -> str:
    UNPICKLED.append("tripwire")
    return "tripped"


class Tripwire:
    """Pickles as a call of _tripwire_unpickled: a full unpickle records it, a weights_only one
    refuses it; either way reading the common state that holds it shows."""

    def __reduce__(self):
        return _tripwire_unpickled, ()


def _swiglu(megatron_cpu, **overrides):
    # gated_linear_unit: linear_fc1 is a ShardedTensorFactory (saved as two tensors, merged on load)
    return megatron_cpu.config(gated_linear_unit=True, **overrides)


def _storage_ranges(path, fqn: str) -> list:
    from torch.distributed.checkpoint import FileSystemReader

    storage = FileSystemReader(str(path)).read_metadata().storage_data
    return [info for index, info in storage.items() if index.fqn == fqn]


# ---------------------------------------------------------------------------- round trips


def test_dist_checkpoint_round_trip_loads_weights_only(megatron_cpu, tmp_path, weights_kit):
    from megatron_rl_patches import build_inference_model, load_inference_weights

    source = megatron_cpu.gpt(seed=11)
    weights_kit.save(source, tmp_path / "ckpt", iteration=7)
    batch = megatron_cpu.batch(seed=5)

    (chunk,) = build_inference_model(megatron_cpu.provider(seed=12), load_dir=tmp_path / "ckpt")
    weights_kit.assert_same(weights_kit.state(chunk), weights_kit.state(source))
    assert torch.equal(megatron_cpu.forward(chunk, batch), megatron_cpu.forward(source.eval(), batch))
    assert all(not p.requires_grad for p in chunk.parameters())

    other = megatron_cpu.gpt(seed=13)
    assert load_inference_weights(other, tmp_path / "ckpt") == 7
    assert load_inference_weights(other, tmp_path / "ckpt" / "iter_0000007") == 7
    assert load_inference_weights(other, tmp_path / "ckpt", iteration=7) == 7
    weights_kit.assert_same(weights_kit.state(other), weights_kit.state(source))


def test_common_state_is_never_unpickled(megatron_cpu, tmp_path, weights_kit):
    from megatron.core import dist_checkpointing

    from megatron_rl_patches import load_inference_weights

    source = megatron_cpu.gpt(_swiglu(megatron_cpu), seed=3)
    args = argparse.Namespace(lr=3e-6, seq_length=16, async_save=False)  # what Megatron-LM pickles
    path = weights_kit.save(source, tmp_path, iteration=4, args=args, tripwire=Tripwire())

    # control: reading the common state (as dist_checkpointing.load does on every version) shows
    UNPICKLED.clear()
    try:
        dist_checkpointing.load_common_state_dict(str(path))
        refused = ""
    except BaseException as exc:  # noqa: BLE001 - torch's weights_only unpickler refuses the tripwire
        refused = str(exc)
    assert UNPICKLED or "_tripwire_unpickled" in refused, "the tripwire would not show a common-state read"

    UNPICKLED.clear()
    target = megatron_cpu.gpt(_swiglu(megatron_cpu), seed=5)
    assert load_inference_weights(target, tmp_path) == 4
    assert UNPICKLED == []
    weights_kit.assert_same(weights_kit.state(target), weights_kit.state(source))


def test_staged_batches_load_the_same_weights(megatron_cpu, tmp_path, weights_kit, monkeypatch):
    from megatron_rl_patches import load_inference_weights
    from megatron_rl_patches.inference.loading import torch_dist as dist_weights

    source = megatron_cpu.gpt(_swiglu(megatron_cpu), seed=6)
    weights_kit.save(source, tmp_path, iteration=1)
    reads = []
    original = dist_weights._read_staged

    def stacked(key: str) -> str:  # the checkpoint saves each layer weight stacked over layers
        return re.sub(r"layers\.\d+\.", "layers.", key)

    def counted(strategy, batch, path):
        reads.append({stacked(key) for state in batch.values() for key in state})
        return original(strategy, batch, path)

    monkeypatch.setattr(dist_weights, "_read_staged", counted)
    monkeypatch.setattr(dist_weights, "STAGING_BYTES", 1)  # the smallest batches there can be
    target = megatron_cpu.gpt(_swiglu(megatron_cpu), seed=7)
    load_inference_weights(target, tmp_path)
    # one weight (or factory) per batch, every layer's shard of it in that batch
    assert all(len(keys) == 1 for keys in reads)
    assert sorted(k for keys in reads for k in keys) == sorted({stacked(k) for k in source.sharded_state_dict()})
    weights_kit.assert_same(weights_kit.state(target), weights_kit.state(source))

    reads.clear()
    monkeypatch.setattr(dist_weights, "STAGING_BYTES", 1 << 30)
    load_inference_weights(megatron_cpu.gpt(_swiglu(megatron_cpu), seed=8), tmp_path)
    assert len(reads) == 1  # the whole tiny model in one batch


def test_dist_checkpoint_into_a_bf16_build(megatron_cpu, tmp_path, weights_kit):
    from megatron_rl_patches import build_inference_model

    source = megatron_cpu.gpt(seed=21)
    weights_kit.save(source, tmp_path, iteration=3)
    config = megatron_cpu.config(bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16)
    (chunk,) = build_inference_model(megatron_cpu.provider(config, seed=22), load_dir=tmp_path)
    for key, value in weights_kit.state(source).items():
        assert torch.equal(weights_kit.state(chunk)[key], value.to(torch.bfloat16)), key


def test_torch_state_dict_file_round_trip(megatron_cpu, tmp_path, weights_kit):
    from megatron.core.transformer.module import Float16Module

    from megatron_rl_patches import build_inference_model, load_inference_weights

    source = megatron_cpu.gpt(seed=31)
    torch.save(source.state_dict(), tmp_path / "weights.pt")
    (chunk,) = build_inference_model(megatron_cpu.provider(seed=32), load_dir=tmp_path / "weights.pt")
    weights_kit.assert_same(weights_kit.state(chunk), weights_kit.state(source))
    batch = megatron_cpu.batch(seed=2)
    assert torch.equal(megatron_cpu.forward(chunk, batch), megatron_cpu.forward(source.eval(), batch))

    # saved from a wrapper ("module." keys) or Megatron-LM style under "model": both accepted
    config = megatron_cpu.config(bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16)
    torch.save(Float16Module(config, megatron_cpu.gpt(config, seed=33)).state_dict(), tmp_path / "wrapped.pt")
    torch.save({"model": source.state_dict()}, tmp_path / "nested.pt")
    target = megatron_cpu.gpt(seed=34)
    assert load_inference_weights(target, tmp_path / "nested.pt") == 0
    weights_kit.assert_same(weights_kit.state(target), weights_kit.state(source))
    bf16_target = Float16Module(config, megatron_cpu.gpt(config, seed=35))
    load_inference_weights(bf16_target, tmp_path / "wrapped.pt")
    expected = Float16Module(config, megatron_cpu.gpt(config, seed=33))
    weights_kit.assert_same(weights_kit.state(bf16_target), weights_kit.state(expected))


# ---------------------------------------------------------------------------- checkpoints that do not fit


def test_bad_checkpoints_raise_clearly_and_change_nothing(megatron_cpu, tmp_path, weights_kit):
    from megatron_rl_patches import load_inference_weights
    from megatron_rl_patches.inference import CheckpointReadError, WeightsMismatchError

    model = megatron_cpu.gpt(seed=41)
    before = weights_kit.state(model)

    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        load_inference_weights(model, tmp_path / "does-not-exist")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no metadata.json"):
        load_inference_weights(model, tmp_path / "empty")
    (tmp_path / "tracked").mkdir()
    (tmp_path / "tracked" / "latest_checkpointed_iteration.txt").write_text("12")
    with pytest.raises(FileNotFoundError, match="iter_0000012"):
        load_inference_weights(model, tmp_path / "tracked")

    wide = megatron_cpu.gpt(megatron_cpu.config(hidden_size=48), seed=42)
    weights_kit.save(wide, tmp_path / "wide", iteration=1)
    first = r"shape mismatches: decoder\.final_layernorm\.bias \(checkpoint \(48,\), model \(32,\)\)"
    with pytest.raises(WeightsMismatchError, match=first) as err:
        load_inference_weights(model, tmp_path / "wide", strict=False)  # shapes: never tolerated
    assert "embedding.word_embeddings.weight (checkpoint (64, 48), model (64, 32))" in err.value.shape_mismatches
    assert len(err.value.shape_mismatches) == 17 and "(12 more)" in str(err.value)  # first few, then a count

    deep = megatron_cpu.gpt(megatron_cpu.config(num_layers=3), seed=43)
    weights_kit.save(deep, tmp_path / "deep", iteration=2)
    with pytest.raises(WeightsMismatchError, match=r"decoder\.layers\.\S+ \(checkpoint \(3, "):
        load_inference_weights(model, tmp_path / "deep")

    state = megatron_cpu.gpt(seed=44).state_dict()
    state.pop("output_layer.weight")
    state["extra.weight"] = torch.zeros(2)
    torch.save(state, tmp_path / "partial.pt")
    with pytest.raises(WeightsMismatchError, match=r"1 missing: output_layer\.weight; 1 unexpected: extra\.weight"):
        load_inference_weights(model, tmp_path / "partial.pt")
    weights_kit.assert_same(weights_kit.state(model), before)  # every failure above left the model untouched

    load_inference_weights(model, tmp_path / "partial.pt", strict=False)  # tolerated: loads the rest
    assert torch.equal(model.embedding.word_embeddings.weight, state["embedding.word_embeddings.weight"])
    assert torch.equal(model.output_layer.weight, before["output_layer.weight"])

    (tmp_path / "junk.pt").write_bytes(b"not a torch file")
    with pytest.raises(CheckpointReadError, match="junk.pt.*not a readable weights-only torch state-dict"):
        load_inference_weights(model, tmp_path / "junk.pt")
    with pytest.raises(TypeError, match="load_dir must be a path"):
        load_inference_weights(model, 42)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        load_inference_weights([], tmp_path / "partial.pt")


def test_dist_checkpoint_missing_keys_strict_and_tolerated(megatron_cpu, tmp_path, caplog, weights_kit):
    from megatron.core import dist_checkpointing

    from megatron_rl_patches import load_inference_weights
    from megatron_rl_patches.inference import WeightsMismatchError

    source = megatron_cpu.gpt(seed=51)
    sharded = source.sharded_state_dict()
    sharded.pop("output_layer.weight")
    dist_checkpointing.save({"model": sharded}, str(tmp_path))
    model = megatron_cpu.gpt(seed=52)
    before = weights_kit.state(model)
    with pytest.raises(WeightsMismatchError, match=r"1 missing: output_layer\.weight"):
        load_inference_weights(model, tmp_path)
    weights_kit.assert_same(weights_kit.state(model), before)
    with caplog.at_level("WARNING", logger="megatron_rl_patches"):
        assert load_inference_weights(model, tmp_path, strict=False) == 0
    assert "1 missing key(s) keep their values (output_layer.weight)" in caplog.text
    assert torch.equal(model.output_layer.weight, before["output_layer.weight"])
    assert torch.equal(model.embedding.word_embeddings.weight, source.embedding.word_embeddings.weight)


# ---------------------------------------------------------------------------- damaged checkpoints (issue 12)


@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_damaged_storage_files_are_refused_before_anything_is_written(megatron_cpu, tmp_path, weights_kit, damage):
    from megatron_rl_patches import load_inference_weights
    from megatron_rl_patches.inference import CheckpointReadError

    saved = weights_kit.save(megatron_cpu.gpt(seed=61), tmp_path / "good", iteration=1)
    model = megatron_cpu.gpt(seed=62)
    before = weights_kit.state(model)
    files = sorted(p.name for p in saved.glob("*.distcp"))
    assert files
    for name in files:  # whichever file is cut, the embeddings and output layer stay as they were
        copy = tmp_path / f"{damage}-{name}"
        shutil.copytree(saved, copy)
        if damage == "truncate":
            data = (copy / name).read_bytes()
            (copy / name).write_bytes(data[: len(data) * 6 // 10])
        else:
            (copy / name).unlink()
        with pytest.raises(CheckpointReadError, match=rf"{name} (holds|is missing)") as err:
            load_inference_weights(model, copy)
        assert isinstance(err.value, Exception) and not err.value.weights_undefined  # `except Exception` sees it
        assert str(copy) in str(err.value) and "nothing was copied" in str(err.value)
        weights_kit.assert_same(weights_kit.state(model), before)


def test_a_read_failing_half_way_says_the_weights_are_undefined(megatron_cpu, tmp_path, weights_kit, monkeypatch):
    from megatron_rl_patches import load_inference_weights
    from megatron_rl_patches.inference import CheckpointReadError
    from megatron_rl_patches.inference.loading import torch_dist as dist_weights

    source = megatron_cpu.gpt(seed=63)
    path = weights_kit.save(source, tmp_path, iteration=1)
    # every file long enough, but the output layer's bytes are garbage (bit rot, a bad copy)
    (info,) = _storage_ranges(path, "output_layer.weight")
    with open(path / info.relative_path, "r+b") as stream:
        stream.seek(info.offset)
        stream.write(b"\xff" * 64)

    model = megatron_cpu.gpt(seed=64)
    before = weights_kit.state(model)
    with pytest.raises(CheckpointReadError, match="reading tensors failed.*nothing was copied") as err:
        load_inference_weights(model, tmp_path)  # one staged batch: it fails before any copy
    assert not err.value.weights_undefined
    weights_kit.assert_same(weights_kit.state(model), before)

    monkeypatch.setattr(dist_weights, "STAGING_BYTES", 1)  # one entry per batch: earlier ones land
    with pytest.raises(CheckpointReadError, match="reading tensors failed.*weights are now UNDEFINED") as err:
        load_inference_weights(model, tmp_path)
    assert err.value.weights_undefined and str(path) in str(err.value)
    assert torch.equal(model.embedding.word_embeddings.weight, source.embedding.word_embeddings.weight)


@pytest.mark.parametrize("target", ["metadata.json", ".metadata", "latest_checkpointed_iteration.txt"])
def test_corrupt_checkpoint_metadata_names_the_file(megatron_cpu, tmp_path, weights_kit, target):
    from megatron_rl_patches import load_inference_weights
    from megatron_rl_patches.inference import CheckpointReadError

    path = weights_kit.save(megatron_cpu.gpt(seed=65), tmp_path, iteration=1)
    damaged = (tmp_path if target.startswith("latest") else path) / target
    damaged.write_bytes(b'\xff{"sharded_backend": "torch_di')  # not UTF-8, cut short
    model = megatron_cpu.gpt(seed=66)
    before = weights_kit.state(model)
    with pytest.raises(CheckpointReadError, match=rf"{str(damaged)!r}.*unreadable.*nothing was copied"):
        load_inference_weights(model, tmp_path)
    weights_kit.assert_same(weights_kit.state(model), before)


def test_checkpoint_metadata_nested_past_the_recursion_limit_names_the_file(megatron_cpu, tmp_path, weights_kit):
    from megatron_rl_patches import load_inference_weights
    from megatron_rl_patches.inference import CheckpointReadError

    path = weights_kit.save(megatron_cpu.gpt(seed=65), tmp_path, iteration=1)
    (path / "metadata.json").write_text("[" * 100_000 + "]" * 100_000)  # json's decoder: RecursionError
    with pytest.raises(CheckpointReadError, match=rf"{str(path / 'metadata.json')!r}: metadata.json nests deeper "
                                                  r"than Python's recursion limit.*nothing was copied"):
        load_inference_weights(megatron_cpu.gpt(seed=66), tmp_path)


@pytest.mark.parametrize("cut", [0.3, 0.6, 0.99])
def test_truncated_state_dict_file_names_the_path(megatron_cpu, tmp_path, weights_kit, cut):
    from megatron_rl_patches import load_inference_weights
    from megatron_rl_patches.inference import CheckpointReadError

    file = tmp_path / "weights.pt"
    torch.save(megatron_cpu.gpt(seed=67).state_dict(), file)
    data = file.read_bytes()
    file.write_bytes(data[: int(len(data) * cut)])
    model = megatron_cpu.gpt(seed=68)
    before = weights_kit.state(model)
    with pytest.raises(CheckpointReadError, match=rf"{str(file)!r}: not a readable weights-only"):
        load_inference_weights(model, file)
    weights_kit.assert_same(weights_kit.state(model), before)


def test_non_tensor_values_are_refused_before_any_chunk_is_written(megatron_cpu, tmp_path, weights_kit):
    from megatron_rl_patches import load_inference_weights
    from megatron_rl_patches.inference import CheckpointReadError

    good = megatron_cpu.gpt(seed=69).state_dict()
    bad = megatron_cpu.gpt(seed=70).state_dict()
    bad["output_layer.weight"] = "not a tensor"
    bad["decoder.final_layernorm.weight"] = torch.zeros(32, dtype=torch.complex64)
    torch.save({"model0": good, "model1": bad}, tmp_path / "two.pt")
    chunks = [megatron_cpu.gpt(seed=71), megatron_cpu.gpt(seed=72)]
    before = [weights_kit.state(chunk) for chunk in chunks]
    with pytest.raises(CheckpointReadError, match="2 value.s. are not weights") as err:
        load_inference_weights(chunks, tmp_path / "two.pt")
    assert "model1.output_layer.weight (str)" in str(err.value)
    assert "model1.decoder.final_layernorm.weight (a torch.complex64 tensor)" in str(err.value)
    for chunk, state in zip(chunks, before):  # chunk 0's (valid) weights were not copied either
        weights_kit.assert_same(weights_kit.state(chunk), state)


# ---------------------------------------------------------------------------- two ranks


def _load_on_two_ranks(rank: int, world_size: int, checkpoint: str) -> dict:
    """Rank 0 reads one entry per batch, rank 1 everything at once (megatron-core < 0.19 reads
    collectively: rank 1 must make matching empty calls); then rank 1's model does not fit the
    checkpoint, and rank 0 must fail too instead of waiting for it."""
    from megatron_rl_patches import load_inference_weights
    from megatron_rl_patches.inference.loading import torch_dist as dist_weights
    from megatron_rl_patches.testing.megatron_cpu import megatron_on_cpu

    out: dict = {}
    with megatron_on_cpu() as env:
        dist_weights.STAGING_BYTES = 1 if rank == 0 else 1 << 30
        model = env.gpt(_swiglu(env), seed=80 + rank)
        load_inference_weights(model, checkpoint)
        # numpy arrays: plain pickles through the result queue (tensors would go as shared memory)
        out["state"] = {k: v.numpy() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
        other = env.gpt(env.config(hidden_size=48 if rank == 1 else 32, gated_linear_unit=True), seed=90)
        try:
            load_inference_weights(other, checkpoint)
        except ValueError as exc:
            out["error"] = f"{type(exc).__name__}: {exc}"
    return out


@pytest.mark.multirank
def test_ranks_with_different_batch_counts_and_a_failing_rank(megatron_cpu, tmp_path, weights_kit):
    source = megatron_cpu.gpt(_swiglu(megatron_cpu), seed=79)
    weights_kit.save(source, tmp_path, iteration=2)
    expected = weights_kit.state(source)
    ranks = run_multirank(_load_on_two_ranks, 2, str(tmp_path), timeout=120)
    for out in ranks:
        weights_kit.assert_same({k: torch.from_numpy(v) for k, v in out["state"].items()}, expected)
    assert ranks[1]["error"].startswith("WeightsMismatchError")
    assert ranks[0]["error"].startswith("CheckpointReadError") and "rank(s) [1] could not use it" in ranks[0]["error"]


# ---------------------------------------------------------------------------- version quirks


def test_the_default_strategy_deprecation_is_silenced_only_inside(caplog):
    from megatron_rl_patches.inference.loading.torch_dist import _quiet_default_strategy

    log = logging.getLogger("megatron.core.dist_checkpointing.serialization")
    message = "megatron.core.dist_checkpointing.serialization.get_default_load_sharded_strategy is deprecated"
    with caplog.at_level("WARNING", logger=log.name):
        with _quiet_default_strategy():
            log.warning(message)  # what megatron-core 0.17 / 0.18 log
            log.warning("another warning")
        log.warning(message)
    assert [r.getMessage() for r in caplog.records] == ["another warning", message]
