"""Residency of inference-only builds on real megatron-core (CPU): a device-byte counter (the
storage sizes of the model's parameters) read during real forwards shows what each mode keeps,
and every mode's outputs equal the resident build's bit for bit (budgets: test_residency_budget.py;
bad input and faults: test_residency_faults.py; TP=2: test_residency_tp.py)."""
from __future__ import annotations

import pytest
import torch

from megatron_rl_patches import build_inference_model, hold, on_device, residency_report
from megatron_rl_patches.inference.residency.storage import device_weight_bytes
from megatron_rl_patches.testing import layouts

pytestmark = pytest.mark.megatron
LAYERS = 4


def _nbytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def _build(env, residency="resident", seed=3, layers=LAYERS, **kwargs):
    config = env.config(num_layers=layers, **kwargs.pop("config", {}))
    return build_inference_model(env.model_provider(config, seed=seed, **kwargs.pop("model", {})),
                                 residency=residency, **kwargs)


def _inner(chunk):
    return getattr(chunk, "module", chunk)


def _watch(chunks, seen: list[int]) -> None:
    """Record the device weight bytes each time a layer, the embedding or the head starts (after
    the residency hooks brought it in), and check the starting piece is complete."""
    model = _inner(chunks[0])
    decoder = model.decoder
    norm = getattr(decoder, "final_layernorm", None) or getattr(decoder, "final_norm", None)
    pieces = [model.embedding, *decoder.layers, norm, model.output_layer]

    def record(module, args):
        assert all(p.untyped_storage().nbytes() == p.numel() * p.element_size() for p in module.parameters())
        seen.append(device_weight_bytes(p for c in chunks for p in c.parameters()))

    for piece in pieces:
        piece.register_forward_pre_hook(record)


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_stream_holds_at_most_prefetch_plus_one_layers(megatron_cpu_kind, prefetch):
    env = megatron_cpu_kind
    reference = _build(env)
    chunks = _build(env, "stream", prefetch=prefetch)
    model = _inner(chunks[0])
    layer = max(_nbytes(layer) for layer in model.decoder.layers)
    norm = getattr(model.decoder, "final_layernorm", None) or model.decoder.final_norm
    ends = max(_nbytes(model.embedding), _nbytes(model.output_layer) + _nbytes(norm))
    seen: list[int] = []
    _watch(chunks, seen)
    assert device_weight_bytes(chunks[0].parameters()) == 0  # nothing on the "device" after the build
    batch = env.batch(seed=1)
    out = env.forward(chunks[0], batch)
    assert torch.equal(out, env.forward(reference[0], batch))
    assert len(seen) == LAYERS + 3
    assert 0 < max(seen) <= (prefetch + 1) * layer + ends
    assert max(seen) < _nbytes(chunks[0])  # never the whole model
    assert device_weight_bytes(chunks[0].parameters()) == 0  # all released after the forward
    report = residency_report(chunks)
    assert report.mode == "stream" and report.device_weight_bytes == 0
    assert report.peak_device_weight_bytes == max(seen)
    assert report.copies == LAYERS + 2 and report.bytes_moved == _nbytes(chunks[0])
    assert report.host_bytes == report.resident_weight_bytes == _nbytes(chunks[0])


def test_swap_holds_the_whole_model_only_inside_its_phase(megatron_cpu):
    env = megatron_cpu
    reference = _build(env)
    chunks = _build(env, "swap")
    total = _nbytes(chunks[0])
    seen: list[int] = []
    _watch(chunks, seen)
    batches = [env.batch(seed=s) for s in (1, 2, 3)]
    assert device_weight_bytes(chunks[0].parameters()) == 0
    with on_device(chunks):
        assert device_weight_bytes(chunks[0].parameters()) == total
        outs = [env.forward(chunks[0], b) for b in batches]
        assert device_weight_bytes(chunks[0].parameters()) == total
    assert device_weight_bytes(chunks[0].parameters()) == 0
    assert residency_report(chunks).copies == 1  # one copy for the phase, three forwards in it
    assert set(seen) == {total}
    for out, batch in zip(outs, batches):
        assert torch.equal(out, env.forward(reference[0], batch))
    # outside a phase each forward swaps the model in and out
    env.forward(chunks[0], batches[0])
    assert device_weight_bytes(chunks[0].parameters()) == 0
    assert residency_report(chunks).copies == 2


def test_host_copies_are_never_modified(megatron_cpu):
    env = megatron_cpu
    chunks = _build(env, "stream")
    owner = chunks[0]._mrp_residency
    before = {key: host.clone() for key, host in owner.host.snapshot().items()}
    for seed in (1, 2):
        env.forward(chunks[0], env.batch(seed=seed))
    after = owner.host.snapshot()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) and before[k].dtype == after[k].dtype for k in before)


def test_hold_copies_a_layer_once_and_turns_its_hooks_off(megatron_cpu):
    env = megatron_cpu
    reference = _build(env)
    chunks = _build(env, "stream")
    layer = _inner(chunks[0]).decoder.layers[1]
    batches = [env.batch(seed=s) for s in (1, 2, 3)]
    with hold(layer):
        with hold(layer):  # nested: counted
            assert device_weight_bytes(layer.parameters()) == _nbytes(layer)
        assert device_weight_bytes(layer.parameters()) == _nbytes(layer)
        outs = [env.forward(chunks[0], b) for b in batches]
        assert device_weight_bytes(chunks[0].parameters()) == _nbytes(layer)  # the held layer only
    assert device_weight_bytes(chunks[0].parameters()) == 0
    copies = residency_report(chunks).copies_by_unit
    assert copies["layer1"] == 1 and copies["layer0"] == copies["layer2"] == 3
    for out, batch in zip(outs, batches):
        assert torch.equal(out, env.forward(reference[0], batch))


def test_hold_and_on_device_are_noops_for_resident_models(megatron_cpu):
    env = megatron_cpu
    chunks = _build(env)
    total = device_weight_bytes(chunks[0].parameters())
    with on_device(chunks), hold(_inner(chunks[0]).decoder.layers[0]):
        assert device_weight_bytes(chunks[0].parameters()) == total
    report = residency_report(chunks)
    assert report.mode == "resident" and report.device_weight_bytes == total and report.copies == 0
    stream = _build(env, "stream")
    with on_device(stream):  # a stream model keeps streaming: nothing held
        assert device_weight_bytes(stream[0].parameters()) == 0


def _tied_gpt_provider(env, seed=3):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    def provider(pre_process=True, post_process=True):
        torch.manual_seed(seed)
        return GPTModel(config=env.config(num_layers=LAYERS), transformer_layer_spec=get_gpt_layer_local_spec(),
                        vocab_size=64, max_sequence_length=16, share_embeddings_and_output_weights=True,
                        pre_process=pre_process, post_process=post_process)

    return provider


@pytest.mark.parametrize("residency", ["swap", "stream"])
def test_tied_embeddings_keep_one_host_copy(megatron_cpu, residency):
    env = megatron_cpu
    reference = build_inference_model(_tied_gpt_provider(env))
    chunks = build_inference_model(_tied_gpt_provider(env), residency=residency)
    model = _inner(chunks[0])
    assert model.output_layer.weight is None  # the output layer reads the embedding's weight
    report = residency_report(chunks)
    assert report.host_bytes == _nbytes(chunks[0])  # unique parameters: one copy of the tied weight
    batch = env.batch(seed=4)
    assert torch.equal(env.forward(chunks[0], batch), env.forward(reference[0], batch))
    assert device_weight_bytes(chunks[0].parameters()) == 0
    if residency == "stream":  # the head brings the shared weight back in: moved twice per forward
        after = residency_report(chunks)
        assert after.copies_by_unit["head"] == 1
        assert after.bytes_moved == _nbytes(chunks[0]) + _nbytes(model.embedding.word_embeddings)


@layouts.mark("bf16")
@pytest.mark.parametrize("residency", ["swap", "stream"])
def test_bf16_build_equals_the_resident_build(megatron_cpu, residency):
    env = megatron_cpu
    bf16 = dict(bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16)
    reference = _build(env, config=bf16)
    chunks = _build(env, residency, config=bf16)
    assert type(chunks[0]).__name__ == "Float16Module"
    batch = env.batch(seed=5)
    out = env.forward(chunks[0], batch)
    assert out.dtype == torch.float32 and torch.equal(out, env.forward(reference[0], batch))
    assert residency_report(chunks).host_bytes == _nbytes(reference[0])  # bf16 bytes, not fp32


@pytest.mark.parametrize("residency", ["swap", "stream"])
def test_weights_load_into_host_memory(megatron_cpu, tmp_path, residency):
    env = megatron_cpu
    source = _build(env, seed=9)
    path = tmp_path / "teacher.pt"
    torch.save(_inner(source[0]).state_dict(), path)
    chunks = _build(env, residency, seed=0, load_dir=path)
    assert device_weight_bytes(chunks[0].parameters()) == 0
    batch = env.batch(seed=6)
    assert torch.equal(env.forward(chunks[0], batch), env.forward(source[0], batch))


def test_virtual_pipeline_chunks_stream_each_their_own_layers(megatron_cpu, monkeypatch):
    from megatron.core import parallel_state

    env = megatron_cpu
    monkeypatch.setattr(parallel_state, "get_virtual_pipeline_model_parallel_world_size", lambda: 2)
    monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_world_size", lambda *a, **k: 2)
    monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_rank", lambda *a, **k: 0)
    inner = env.model_provider(env.config(num_layers=2), seed=3)

    def provider(pre_process, post_process, vp_stage=None):  # whole models: each chunk runs alone here
        return inner(True, True, vp_stage)

    chunks = build_inference_model(provider, residency="stream")
    names = [unit.name for unit in chunks[0]._mrp_residency.units]
    assert names == ["embedding", "layer0", "layer1", "head", "chunk1.embedding", "chunk1.layer0", "chunk1.layer1",
                     "chunk1.head"]
    swap = build_inference_model(provider, residency="swap")
    with on_device(swap[1]):
        assert device_weight_bytes(swap[1].parameters()) == _nbytes(swap[1])
        assert device_weight_bytes(swap[0].parameters()) == 0
        env.forward(swap[0], env.batch(seed=1))  # chunk 0 swaps in and out on its own
        assert device_weight_bytes(swap[0].parameters()) == 0
    assert residency_report(swap).copies_by_unit == {"chunk0": 1, "chunk1": 1}
