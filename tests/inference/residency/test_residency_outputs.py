"""Swap and stream builds give the resident build's outputs bit for bit through the fused output
processors: log-probs and entropy, top-k buckets of a teacher scoring a student's ids, and a
full-vocabulary divergence that reads the teacher's hidden states and output weight. GPTModel, and
HybridModel (patch `hybrid_output_processor`) where megatron-core has it."""
from __future__ import annotations

import pytest
import torch

import megatron_rl_patches
from megatron_rl_patches import (
    build_inference_model,
    divergence_output_processor,
    hidden_output_processor,
    hold,
    log_prob_output_processor,
    topk_output_processor,
)
from megatron_rl_patches.inference.residency.storage import device_weight_bytes
from megatron_rl_patches.testing import layouts

pytestmark = [pytest.mark.megatron, layouts.mark("bshd")]
MODES = ["swap", "stream"]
# GPTModel's hook (`native` on >= 0.18) and HybridModel's
PROCESSOR_PATCHES = ["gpt_output_processor", "hybrid_output_processor"]


def _teacher(env, residency="resident"):
    return build_inference_model(env.model_provider(env.config(num_layers=3), seed=5), residency=residency)[0]


def _args(batch):
    return batch["tokens"], batch["position_ids"], batch["attention_mask"]


@pytest.mark.parametrize("residency", MODES)
def test_fused_log_probs_and_top_k_buckets_equal_the_resident_build(megatron_cpu_kind, clean_patch_state, residency):
    megatron_rl_patches.apply(only=PROCESSOR_PATCHES)
    env = megatron_cpu_kind
    reference, teacher = _teacher(env), _teacher(env, residency)
    batch = env.batch(seed=8)
    processor = log_prob_output_processor(temperature=0.7, with_entropy=True)
    with torch.no_grad():
        want = reference(*_args(batch), labels=batch["labels"], output_processor=processor)
        got = teacher(*_args(batch), labels=batch["labels"], output_processor=processor)
    assert torch.equal(got["log_probs"], want["log_probs"]) and torch.equal(got["entropy"], want["entropy"])
    assert device_weight_bytes(teacher.parameters()) == 0

    ids = torch.rand(2, 16, 64, generator=torch.Generator().manual_seed(2)).topk(4, dim=-1).indices  # distinct
    scoring = dict(output_processor=topk_output_processor(), output_processor_context={"ids": ids})
    with torch.no_grad():
        want = reference(*_args(batch), **scoring)
        got = teacher(*_args(batch), **scoring)
    assert torch.equal(got["topk_log_probs"], want["topk_log_probs"]) and torch.equal(got["tail"], want["tail"])
    assert device_weight_bytes(teacher.parameters()) == 0


@pytest.mark.parametrize("residency", MODES)
def test_divergence_from_a_streamed_teacher_equals_the_resident_one(megatron_cpu_kind, clean_patch_state, residency):
    megatron_rl_patches.apply(only=PROCESSOR_PATCHES)
    env = megatron_cpu_kind
    student = env.model(env.config(num_layers=2), seed=1)
    reference, teacher = _teacher(env), _teacher(env, residency)
    batch = env.batch(seed=9)
    processor = divergence_output_processor(divergence="jsd", beta=0.4)

    def divergence(model):
        with torch.no_grad():
            hidden = model(*_args(batch), output_processor=hidden_output_processor())
        context = {"teacher_hidden": [hidden], "teacher_weight": [model.output_layer.weight]}
        return student(*_args(batch), output_processor=processor, output_processor_context=context)

    want = divergence(reference)
    want.sum().backward()
    expected = {name: p.grad.clone() for name, p in student.named_parameters()}
    student.zero_grad(set_to_none=True)
    # the student's forward and backward read the teacher's output weight after the teacher's
    # forward returned: hold it until then
    with hold(teacher.output_layer):
        got = divergence(teacher)
        got.sum().backward()
    assert torch.equal(got, want)
    assert all(torch.equal(p.grad, expected[name]) for name, p in student.named_parameters())
    assert all(p.grad is None for p in teacher.parameters())
    assert device_weight_bytes(teacher.parameters()) == 0
