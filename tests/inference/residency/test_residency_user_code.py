"""What user code does around a swap/stream teacher's forward: a forward called from inside the
same model's forward (reference counts per piece), an input that requires grad (refused before
anything moves, unless the weights are held for the backward), a KeyboardInterrupt inside a
forward (released like any exception, a shared budget left usable), and layer-major scoring with
prefetch under a budget that has room for one piece only (the look-ahead waits)."""
from __future__ import annotations

import pytest
import torch

from megatron_rl_patches import (
    ResidencyBudget,
    build_inference_model,
    hold,
    on_device,
    residency_report,
    score_layer_major,
)
from megatron_rl_patches.inference.residency.storage import device_weight_bytes

pytestmark = pytest.mark.megatron
LAYERS = 3


def _build(env, residency="resident", seed=3, **kwargs):
    provider = env.model_provider(env.config(num_layers=LAYERS), seed=seed)
    return build_inference_model(provider, residency=residency, **kwargs)


def _call(chunk, batch, **kwargs):
    return chunk(batch["tokens"], batch["position_ids"], batch["attention_mask"], **kwargs)


@pytest.mark.parametrize("residency", ["swap", "stream"])
def test_a_forward_inside_the_same_models_forward(megatron_cpu, residency):
    env = megatron_cpu
    reference = _build(env)[0]
    chunk = _build(env, residency)[0]
    outer_batch, inner_batch = env.batch(seed=1), env.batch(seed=2)
    inner: list[torch.Tensor] = []
    started: list[bool] = []

    def score_inside(module, args):
        if not started:  # once: the inner forward runs this hook too
            started.append(True)
            inner.append(_call(chunk, inner_batch))

    handle = chunk.decoder.layers[1].self_attention.register_forward_pre_hook(score_inside)
    with torch.no_grad():
        outer = _call(chunk, outer_batch)
    handle.remove()
    with torch.no_grad():
        assert torch.equal(outer, _call(reference, outer_batch))
        assert torch.equal(inner[0], _call(reference, inner_batch))
    assert device_weight_bytes(chunk.parameters()) == 0
    assert not any(unit.active for unit in chunk._mrp_residency.units)


@pytest.mark.parametrize("residency", ["swap", "stream"])
def test_an_input_that_requires_grad(megatron_cpu, residency):
    env = megatron_cpu
    reference = _build(env)[0]
    chunks = _build(env, residency)
    batch = env.batch(seed=4)
    hidden = torch.randn(16, 2, 32, generator=torch.Generator().manual_seed(0))

    def gradient(chunk):
        h = hidden.clone().requires_grad_()
        _call(chunk, batch, decoder_input=h).sum().backward()
        return h.grad

    copies = residency_report(chunks).copies
    with pytest.raises(ValueError, match=f"requires grad, but residency='{residency}' sends its weights back"):
        gradient(chunks[0])
    assert residency_report(chunks).copies == copies and device_weight_bytes(chunks[0].parameters()) == 0
    # grad mode on, no input requiring grad: works as before
    assert torch.equal(_call(chunks[0], batch, decoder_input=hidden), _call(reference, batch, decoder_input=hidden))
    # weights kept on the device for the forward and the backward: the resident build's gradient
    with on_device(chunks) if residency == "swap" else hold(chunks[0]):
        got = gradient(chunks[0])
    assert torch.equal(got, gradient(reference))
    assert device_weight_bytes(chunks[0].parameters()) == 0


@pytest.mark.parametrize("residency", ["swap", "stream"])
def test_keyboard_interrupt_inside_a_forward_releases_everything(megatron_cpu, residency):
    env = megatron_cpu
    reference = _build(env)[0]
    size = sum(p.numel() * p.element_size() for p in reference.parameters())
    budget = ResidencyBudget(size)  # room for one whole teacher
    first, second = _build(env, residency, budget=budget)[0], _build(env, residency, budget=budget)[0]
    batch = env.batch(seed=5)

    def interrupt(module, args):
        raise KeyboardInterrupt

    handle = first.decoder.layers[1].register_forward_pre_hook(interrupt)
    with pytest.raises(KeyboardInterrupt), torch.no_grad():
        _call(first, batch)
    handle.remove()
    assert not any(unit.active for unit in first._mrp_residency.units)
    if residency == "stream":
        assert device_weight_bytes(first.parameters()) == 0 and budget.in_use == 0
    with torch.no_grad():  # the other teacher finds room, the interrupted one works again
        want = _call(reference, batch)
        assert torch.equal(_call(second, batch), want)
        assert torch.equal(_call(first, batch), want)
    assert budget.peak <= budget.bytes


@pytest.mark.parametrize("prefetch", [1, 2])
def test_layer_major_prefetch_waits_for_room_in_a_tight_budget(megatron_cpu, prefetch):
    env = megatron_cpu
    reference = _build(env)
    model = reference[0]
    pieces = [model.embedding, *model.decoder.layers]
    largest = max(sum(p.numel() * p.element_size() for p in piece.parameters()) for piece in pieces)
    head = sum(p.numel() * p.element_size() for m in (model.decoder.final_layernorm, model.output_layer)
               for p in m.parameters())
    budget = ResidencyBudget(max(largest, head))
    chunks = _build(env, "stream", prefetch=prefetch, budget=budget)
    batches = [{"input_ids": b["tokens"], "position_ids": b["position_ids"], "attention_mask": b["attention_mask"]}
               for b in (env.batch(seed=s) for s in (6, 7))]
    with torch.no_grad():
        want = [reference[0](**b) for b in batches]
        per_batch = [chunks[0](**b) for b in batches]
    got = score_layer_major(chunks, batches)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert all(torch.equal(a, b) for a, b in zip(per_batch, want))
    assert budget.peak <= budget.bytes and budget.in_use == 0
    assert device_weight_bytes(chunks[0].parameters()) == 0


def test_a_load_between_phases_reaches_a_swap_model_its_budget_keeps_cached(megatron_cpu):
    env = megatron_cpu
    reference, other = _build(env)[0], _build(env, seed=8)[0]
    size = sum(p.numel() * p.element_size() for p in reference.parameters())
    budget = ResidencyBudget(2 * size)
    chunk = _build(env, "swap", budget=budget)[0]
    batch = env.batch(seed=9)
    with torch.no_grad():
        assert torch.equal(_call(chunk, batch), _call(reference, batch))
        assert device_weight_bytes(chunk.parameters()) == size  # cached on the device between phases
        assert all(p.untyped_storage().data_ptr() == h.untyped_storage().data_ptr()
                   for p, h in zip(chunk.parameters(), chunk._mrp_residency.host.snapshot().values()))
        chunk.load_state_dict(other.state_dict())  # writes the host copies: the cached copy is stale
        assert torch.equal(_call(chunk, batch), _call(other, batch))
    assert residency_report([chunk]).copies == 2 and budget.in_use == size


@pytest.mark.parametrize("residency", ["swap", "stream"])
def test_writes_while_the_weights_are_on_the_device_are_kept(megatron_cpu, residency):
    env = megatron_cpu
    other = _build(env, seed=8)[0]
    chunks = _build(env, residency)
    batch = env.batch(seed=10)
    with on_device(chunks) if residency == "swap" else hold(chunks[0]):
        chunks[0].load_state_dict(other.state_dict())  # into the device copies
    with torch.no_grad():
        assert torch.equal(_call(chunks[0], batch), _call(other, batch))
        with on_device(chunks) if residency == "swap" else hold(chunks[0]):
            chunks[0].double()  # replaces .data on the device
        assert all(p.dtype == torch.float64 for p in chunks[0].parameters())
        assert device_weight_bytes(chunks[0].parameters()) == 0
        assert torch.equal(_call(chunks[0], batch), _call(other.double(), batch))
