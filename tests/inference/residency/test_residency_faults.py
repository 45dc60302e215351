"""Residency: bad arguments are refused before anything is built, trainable or DDP models are
refused untouched, and an exception inside a forward leaves nothing on the device."""
from __future__ import annotations

import pytest
import torch

from megatron_rl_patches import ResidencyBudget, build_inference_model, residency_report
from megatron_rl_patches.inference.residency.placement import attach_residency
from megatron_rl_patches.inference.residency.storage import device_weight_bytes

pytestmark = pytest.mark.megatron


def _provider(env, calls=None, layers=3):
    inner = env.model_provider(env.config(num_layers=layers), seed=3)

    def provider(pre_process=True, post_process=True):
        if calls is not None:
            calls.append(1)
        return inner(pre_process, post_process)

    return provider


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(residency="offload"), ValueError, "residency must be one of 'resident', 'swap', 'stream'"),
        (dict(residency=None), ValueError, "residency must be one of"),
        (dict(residency="stream", prefetch=-1), ValueError, "prefetch must be an int >= 0"),
        (dict(residency="stream", prefetch=True), ValueError, "prefetch must be an int >= 0"),
        (dict(residency="stream", prefetch=1.5), ValueError, "prefetch must be an int >= 0"),
        (dict(residency="swap", budget=1 << 20), TypeError, "budget must be a ResidencyBudget"),
        (dict(budget="budget"), TypeError, "budget must be a ResidencyBudget"),
    ],
)
def test_bad_arguments_fail_before_the_build(megatron_cpu, kwargs, error, message):
    calls: list[int] = []
    with pytest.raises(error, match=message):
        build_inference_model(_provider(megatron_cpu, calls), **kwargs)
    assert calls == []


def test_budget_with_a_resident_build_is_refused(megatron_cpu):
    with pytest.raises(ValueError, match="budget= caps the device bytes of residency='swap' or 'stream'"):
        build_inference_model(_provider(megatron_cpu), budget=ResidencyBudget(1 << 20))


@pytest.mark.parametrize("value", [0, -5, 1.0, True, "1GB"])
def test_budget_must_be_positive_bytes(value):
    with pytest.raises(ValueError, match="ResidencyBudget\\(bytes=...\\) must be a positive int"):
        ResidencyBudget(value)


def test_budget_smaller_than_the_largest_layer_is_refused(megatron_cpu):
    budget = ResidencyBudget(1000)
    with pytest.raises(ValueError, match=r"budget of 1000 bytes is smaller than the largest single piece .* needs \d+"):
        build_inference_model(_provider(megatron_cpu), residency="stream", budget=budget)
    assert budget.in_use == 0


def test_trainable_and_ddp_models_are_refused_untouched(megatron_cpu):
    env = megatron_cpu
    trainable = env.model(env.config(num_layers=2), seed=1)
    before = {name: p.detach().clone() for name, p in trainable.named_parameters()}
    with pytest.raises(TypeError, match="model chunk 0 is trainable: residency applies to frozen models only"):
        attach_residency([trainable], "stream")
    ddp = env.ddp(env.model(env.config(num_layers=2), seed=1))
    with pytest.raises(TypeError, match="model chunk 0 is DDP-wrapped"):
        attach_residency([ddp], "swap")
    assert all(torch.equal(p, before[name]) for name, p in trainable.named_parameters())
    assert device_weight_bytes(trainable.parameters()) == sum(v.nbytes for v in before.values())


def test_a_second_residency_is_refused(megatron_cpu):
    chunks = build_inference_model(_provider(megatron_cpu), residency="swap")
    with pytest.raises(ValueError, match="already have a residency"):
        attach_residency(chunks, "stream")


def test_stream_needs_decoder_layers(megatron_cpu):
    def provider(pre_process=True, post_process=True):
        return torch.nn.Linear(4, 4)

    with pytest.raises(ValueError, match="needs a Megatron language model with decoder.layers .* use residency='swap'"):
        build_inference_model(provider, residency="stream")
    (chunk,) = build_inference_model(provider, residency="swap")  # any module swaps whole
    assert torch.equal(chunk(torch.ones(1, 4)), chunk(torch.ones(1, 4)))
    assert device_weight_bytes(chunk.parameters()) == 0


def test_multi_token_prediction_block_streams_as_one_unit(megatron_cpu):
    """The MTP block is a unit of its own after the head (megatron runs it between the final norm and
    the output layer); a real MTP GPT streams in tests/processors/layouts/test_mtp_layouts.py."""
    from megatron_rl_patches.inference.residency.units import stream_units

    class WithMTP(torch.nn.Module):  # the shape stream_units reads
        def __init__(self):
            super().__init__()
            self.decoder = torch.nn.Module()
            self.decoder.layers = torch.nn.ModuleList([torch.nn.Linear(2, 2)])
            self.mtp = torch.nn.Linear(2, 2)

    model = WithMTP()
    units = stream_units(model, 0)
    assert [unit.name for unit in units] == ["layer0", "mtp"]
    assert {id(p) for p in units[-1].params} == {id(p) for p in model.mtp.parameters()}


@pytest.mark.parametrize("residency", ["swap", "stream"])
def test_an_exception_inside_a_forward_leaves_nothing_resident(megatron_cpu, residency):
    env = megatron_cpu
    reference = build_inference_model(_provider(env))
    chunks = build_inference_model(_provider(env), residency=residency)
    layer = chunks[0].decoder.layers[1]
    original = layer.forward

    def broken(*args, **kwargs):
        raise RuntimeError("injected fault")

    layer.forward = broken
    batch = env.batch(seed=2)
    with pytest.raises(RuntimeError, match="injected fault"):
        env.forward(chunks[0], batch)
    assert device_weight_bytes(chunks[0].parameters()) == 0
    assert not any(unit.active or unit.cached for unit in chunks[0]._mrp_residency.units)
    layer.forward = original
    assert torch.equal(env.forward(chunks[0], batch), env.forward(reference[0], batch))
    assert device_weight_bytes(chunks[0].parameters()) == 0


def test_train_and_optimizers_are_refused_as_for_any_inference_build(megatron_cpu):
    from megatron_rl_patches.inference import InferenceOnlyError, assert_trainable

    chunks = build_inference_model(_provider(megatron_cpu), residency="stream")
    chunks[0].train()
    assert not any(m.training for m in chunks[0].modules())
    with pytest.raises(InferenceOnlyError):
        assert_trainable(chunks, "build an optimizer for")
    with pytest.raises(InferenceOnlyError):
        chunks[0].finish_grad_sync()
    assert residency_report(chunks).mode == "stream"


def test_pinning_failure_falls_back_to_pageable_with_a_warning(monkeypatch):
    from megatron_rl_patches.inference.residency import storage as residency_storage

    def refuse(self):
        raise RuntimeError("cannot pin")

    monkeypatch.setattr(torch.Tensor, "pin_memory", refuse)
    total = [1234]
    with pytest.warns(RuntimeWarning, match="pinning 1234 bytes of host weights failed"):
        host = residency_storage.pin_host_copy(torch.ones(3), total)
    assert not host.is_pinned() and torch.equal(host, torch.ones(3))
