"""The output processors (log-prob + entropy, top-k buckets, divergence from a teacher) on a real
tiny GPTModel under activation recompute (`recompute_granularity="full"`, every layer recomputed
in backward: the layer calls are counted) and in bf16 (Float16Module, bf16 parameters): values and
every parameter's gradient equal the model's own logits path (at recompute: the same model without
recompute). Negative controls: the call count of a model without recompute, and the logits path at
another temperature, which each comparison tells apart."""
from __future__ import annotations

from functools import partial

import pytest
import torch
from kit import logits_reference

import megatron_rl_patches
from megatron_rl_patches import (
    divergence_output_processor,
    hidden_output_processor,
    log_prob_output_processor,
    topk_output_processor,
)
from megatron_rl_patches.testing import layouts
from megatron_rl_patches.testing.compare import grad_error, relative_error

pytestmark = pytest.mark.megatron
PROCESSORS = ("log-prob", "top-k", "divergence")
# relative to the reference's own largest magnitude (no floor at 1: the gradients are small)
error = partial(relative_error, floor=0.0)
grads_error = partial(grad_error, floor=0.0)
B, S, V, K = 2, 16, 64, 4
# the divergence against the float64 dense route: fp32 rounding of values ~1e-3
REL = {"log-prob": 2e-6, "top-k": 2e-6, "divergence": 5e-5}
OTHER_TEMPERATURE = 1.5
RECOMPUTE = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
BF16 = dict(bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16)


def _args(batch):
    return batch["tokens"], batch["position_ids"], batch["attention_mask"]


def _fused(model, teacher, batch, which: str, temperature: float = 1.0) -> torch.Tensor:
    """What the processor returns, as one tensor per token ([b, s] or [b, s, k + 1])."""
    if which == "log-prob":
        out = model(*_args(batch), labels=batch["labels"],
                    output_processor=log_prob_output_processor(temperature=temperature, with_entropy=True))
        return out["log_probs"] + 0.5 * out["entropy"]
    if which == "top-k":
        out = model(*_args(batch), output_processor=topk_output_processor(k=K, temperature=temperature))
        return torch.cat([out["topk_log_probs"], out["tail"][..., None]], dim=-1)
    with torch.no_grad():
        hidden = teacher(*_args(batch), output_processor=hidden_output_processor())
    weight = _unwrapped(teacher).output_layer.weight
    # a bf16 teacher in Float16Module hands its hidden states back as fp32 beside its bf16 weight:
    # the processor takes them in the weight's dtype (docs/distillation.md)
    return model(*_args(batch), output_processor=divergence_output_processor(divergence="jsd", beta=0.4,
                                                                            temperature=temperature),
                 output_processor_context={"teacher_hidden": hidden, "teacher_weight": weight})


def _logits_route(model, teacher, batch, which: str, temperature: float = 1.0) -> torch.Tensor:
    """The same from the model's logits [b, s, V] (top-k at the ids the logits' own top-k picks)."""
    rows = model(*_args(batch)).reshape(B * S, V)
    teacher_rows = None
    if which == "divergence":
        with torch.no_grad():
            teacher_rows = teacher(*_args(batch)).reshape(B * S, V)
    out = logits_reference.from_logits(which, rows, batch["labels"].reshape(-1), K, teacher_rows=teacher_rows,
                                       temperature=temperature)
    if which == "log-prob":
        return (out[0] + 0.5 * out[1]).view(B, S)
    if which == "top-k":
        return torch.cat([out[0], out[1][:, None]], dim=-1).view(B, S, K + 1)
    return out[0].view(B, S)


def _unwrapped(model):
    return getattr(model, "module", model)


def _scored(model, route, teacher, batch, which: str, temperature: float = 1.0) -> tuple[torch.Tensor, dict]:
    """The route's values and the gradients of a weighted sum of them; zeroes the gradients."""
    values = route(model, teacher, batch, which, temperature)
    weights = torch.randn(values.shape, generator=torch.Generator().manual_seed(5)).to(values.dtype)
    (weights * values).sum().backward()
    grads = {name: p.grad.float().clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return values.detach().float(), grads






def _teacher(env, **config):
    teacher = env.gpt(env.config(**config), seed=9)
    return teacher.eval().requires_grad_(False)


def _count_layer_calls(model) -> list[int]:
    calls = [0]
    for layer in model.decoder.layers:
        layer.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


@layouts.mark("recompute")
@pytest.mark.parametrize("which", PROCESSORS)
def test_processors_under_full_activation_recompute(megatron_cpu, clean_patch_state, which):
    megatron_rl_patches.apply(only="gpt_output_processor")  # `native` on megatron-core >= 0.18
    env = megatron_cpu
    recomputed, plain = env.gpt(env.config(**RECOMPUTE), seed=3), env.gpt(seed=3)
    teacher, batch = _teacher(env), env.batch(seed=7)
    recomputed_calls, plain_calls = _count_layer_calls(recomputed), _count_layer_calls(plain)

    got, got_grads = _scored(recomputed, _fused, teacher, batch, which)
    layers = len(recomputed.decoder.layers)
    assert recomputed_calls[0] == 2 * layers  # each layer again in backward: recompute really ran
    want, want_grads = _scored(plain, _logits_route, teacher, batch, which)
    assert plain_calls[0] == layers  # the control: without recompute, once
    same_route, same_route_grads = _scored(recomputed, _logits_route, teacher, batch, which)
    assert error(got, want) <= REL[which] and grads_error(got_grads, want_grads) <= REL[which]
    assert error(same_route, want) <= REL[which] and grads_error(same_route_grads, want_grads) <= REL[which]
    other, other_grads = _scored(plain, _logits_route, teacher, batch, which, temperature=OTHER_TEMPERATURE)
    assert error(got, other) > 1e-2 and grads_error(got_grads, other_grads) > 1e-2  # the comparison sees it


@layouts.mark("bf16")
@pytest.mark.parametrize("which", PROCESSORS)
def test_processors_on_a_bf16_float16module(megatron_cpu, clean_patch_state, which):
    from megatron.core.transformer.module import Float16Module

    megatron_rl_patches.apply(only="gpt_output_processor")
    env = megatron_cpu
    config = env.config(**BF16)
    model = Float16Module(config, env.gpt(config, seed=3))
    teacher = Float16Module(config, _teacher(env, **BF16))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    batch = env.batch(seed=7)

    got, got_grads = _scored(model, _fused, teacher, batch, which)
    want, want_grads = _scored(model, _logits_route, teacher, batch, which)
    assert error(got, want) <= REL[which], error(got, want)
    assert grads_error(got_grads, want_grads) <= 1e-2, grads_error(got_grads, want_grads)  # bf16 gradients
    other, other_grads = _scored(model, _logits_route, teacher, batch, which, temperature=OTHER_TEMPERATURE)
    assert error(got, other) > 1e-2 and grads_error(got_grads, other_grads) > 5e-2


@layouts.mark("bf16")
def test_a_bf16_float16module_teacher_distils_an_fp32_student(megatron_cpu, clean_patch_state):
    """The teacher's fp32 (upcast) hidden states and bf16 output weight, as Float16Module hands them,
    straight into the divergence processor of an fp32 student: the dense float64 divergence from
    the teacher's own logits, values and every gradient."""
    from megatron.core.transformer.module import Float16Module

    megatron_rl_patches.apply(only="gpt_output_processor")
    env = megatron_cpu
    config = env.config(**BF16)
    teacher = Float16Module(config, _teacher(env, **BF16))
    student, batch = env.gpt(seed=3), env.batch(seed=7)
    with torch.no_grad():
        hidden = teacher(*_args(batch), output_processor=hidden_output_processor())
    assert hidden.dtype == torch.float32 and _unwrapped(teacher).output_layer.weight.dtype == torch.bfloat16

    got, got_grads = _scored(student, _fused, teacher, batch, "divergence")
    want, want_grads = _scored(student, _logits_route, teacher, batch, "divergence")
    assert error(got, want) <= REL["divergence"], error(got, want)
    assert grads_error(got_grads, want_grads) <= REL["divergence"], grads_error(got_grads, want_grads)
    other, other_grads = _scored(student, _logits_route, teacher, batch, "divergence", temperature=OTHER_TEMPERATURE)
    assert error(got, other) > 1e-2 and grads_error(got_grads, other_grads) > 1e-2  # the comparison sees it
