"""Issue 19, defects 2 and 3, on a real tiny GPTModel (megatron-core < 0.18 through the
`gpt_output_processor` patch, >= 0.18 natively): with either fused processor the output layer's
forward pre-hooks run exactly once per forward, as in a plain forward (before: twice on < 0.18,
once for the stand-in call and once in wait_for_output_weight), and a `forward` the user set on
the output layer instance is still there afterwards (before: deleted on < 0.18)."""
from __future__ import annotations

import pytest
import torch

import megatron_rl_patches
from megatron_rl_patches import log_prob_output_processor, topk_output_processor

pytestmark = pytest.mark.megatron


def _run(model, batch, processor=None, context=None):
    args = (batch["tokens"], batch["position_ids"], batch["attention_mask"])
    if processor is None:
        return model(*args)
    return model(*args, labels=batch["labels"], output_processor=processor, output_processor_context=context)


def _processors(batch):
    ids = torch.stack([torch.randperm(64, generator=torch.Generator().manual_seed(i))[:3] for i in range(32)])
    return {
        "plain": (None, None),
        "log_probs": (log_prob_output_processor(with_entropy=True), None),
        "topk_student": (topk_output_processor(k=3), None),
        "topk_teacher": (topk_output_processor(), {"ids": ids.reshape(2, 16, 3)}),
    }


@pytest.mark.parametrize("route", ["plain", "log_probs", "topk_student", "topk_teacher"])
def test_output_layer_pre_hooks_run_once_per_forward(megatron_cpu, clean_patch_state, route):
    megatron_rl_patches.apply(only="gpt_output_processor")  # `native` on >= 0.18
    model = megatron_cpu.gpt(seed=0)
    batch = megatron_cpu.batch(seed=1)
    calls = {"plain": 0, "with_kwargs": 0}

    def plain_hook(module, args):
        assert module is model.output_layer and args[0].shape == (16, 2, 32)
        calls["plain"] += 1

    def kwargs_hook(module, args, kwargs):
        calls["with_kwargs"] += 1

    model.output_layer.register_forward_pre_hook(plain_hook)
    model.output_layer.register_forward_pre_hook(kwargs_hook, with_kwargs=True)
    processor, context = _processors(batch)[route]
    for forwards in (1, 2):
        _run(model, batch, processor, context)
        assert calls == {"plain": forwards, "with_kwargs": forwards}


@pytest.mark.parametrize("route", ["log_probs", "topk_student"])
def test_a_forward_set_on_the_output_layer_instance_survives(megatron_cpu, clean_patch_state, route):
    megatron_rl_patches.apply(only="gpt_output_processor")
    model = megatron_cpu.gpt(seed=0)
    batch = megatron_cpu.batch(seed=1)
    layer = model.output_layer
    expected = _run(model, batch)
    seen = []

    def own_forward(*args, **kwargs):  # e.g. a user's logging or LoRA-style override
        seen.append(1)
        return type(layer).forward(layer, *args, **kwargs)

    layer.forward = own_forward
    processor, context = _processors(batch)[route]
    _run(model, batch, processor, context)
    assert layer.__dict__.get("forward") is own_forward
    seen.clear()
    assert torch.equal(_run(model, batch), expected) and seen == [1]  # later plain calls still use it
