"""Full-vocabulary distillation through the output processors only: a real GPTModel student in real
megatron-core DDP with Megatron's optimizer, two inference-only GPT teachers returning their final
hidden states (`hidden_output_processor`), the student's per-token divergence from their mixture
(`divergence_output_processor`, the teachers' hidden states and output weights through
`output_processor_context`). For every divergence the first step's loss and gradients equal the
dense float64 route on the models' logits; training on jsd lowers the loss; no [T, V] tensor is
ever created, in forward or backward (`testing.vocab_watch`)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import megatron_rl_patches
from megatron_rl_patches import divergence_output_processor, hidden_output_processor
from megatron_rl_patches.ops._divergences import DIVERGENCES
from megatron_rl_patches.testing import layouts
from megatron_rl_patches.testing.divergence_reference import dense_divergence
from megatron_rl_patches.testing.vocab_watch import VocabWideTensors

sys.path.insert(0, str(Path(__file__).parent))
# the same student (DDP, Megatron's Adam) and inference-only teachers as the top-k training test
from test_fused_topk_training import BATCH, SEQ, TEACHER_WEIGHTS, VOCAB, _args, _backward, _student, _teachers  # noqa: E402

pytestmark = pytest.mark.megatron

ROWS = BATCH * SEQ  # T
CHUNK_ROWS = 16  # the op's row tiles: [16, V] logits tiles at most, never [T, V]
STEPS = 8
OPTIONS = dict(beta=0.4, alpha=0.2, teacher_weights=TEACHER_WEIGHTS, temperature=0.9)


def _fused_loss(student, teachers, batch, divergence) -> torch.Tensor:
    with torch.no_grad():
        hidden = [t(*_args(batch), output_processor=hidden_output_processor()) for t in teachers]
    assert hidden[0].shape == (BATCH, SEQ, 64)
    context = {"teacher_hidden": hidden, "teacher_weight": [t.output_layer.weight for t in teachers]}
    processor = divergence_output_processor(divergence=divergence, chunk_size=CHUNK_ROWS, **OPTIONS)
    out = student(*_args(batch), output_processor=processor, output_processor_context=context)
    assert out.shape == (BATCH, SEQ)
    return out.mean()


def _dense_loss(student, teachers, batch, divergence) -> torch.Tensor:
    logits = student(*_args(batch))  # [b, s, V] through the output layer
    with torch.no_grad():
        teacher_logits = [t(*_args(batch)).double().reshape(ROWS, VOCAB) for t in teachers]
    return dense_divergence(logits.double().reshape(ROWS, VOCAB), teacher_logits, divergence=divergence,
                            **OPTIONS).mean()


@layouts.mark("bshd")
def test_two_teacher_full_vocabulary_distillation_without_logits(megatron_cpu, clean_patch_state):
    megatron_rl_patches.apply(only="gpt_output_processor")  # `native` on megatron-core >= 0.18
    student, optimizer = _student(megatron_cpu)
    teachers = _teachers(megatron_cpu)
    teacher_weights_before = [[p.clone() for p in t.parameters()] for t in teachers]
    batches = [megatron_cpu.batch(BATCH, SEQ, VOCAB, seed=s) for s in range(2)]

    # The first step, every divergence: fused loss and gradients equal the dense float64 route.
    for divergence in DIVERGENCES:
        with VocabWideTensors(VOCAB) as fused_first:
            fused = _fused_loss(student, teachers, batches[0], divergence)
            fused_grads = _backward(student, fused)
        with VocabWideTensors(VOCAB) as dense_route:
            reference = _dense_loss(student, teachers, batches[0], divergence)
            reference_grads = _backward(student, reference)
        assert dense_route.largest_bytes >= ROWS * VOCAB * 4, "the watch must see the dense route's [T, V] tensors"
        assert fused_first.largest_shape == (CHUNK_ROWS, VOCAB), (divergence, fused_first.largest_shape)
        assert float(reference) > 1e-3, divergence
        assert float(fused) == pytest.approx(float(reference), rel=1e-5), divergence
        scale = float(reference_grads.abs().max())
        assert scale > 0 and float((fused_grads - reference_grads).abs().max()) <= 1e-4 * scale, divergence

    losses = []
    with VocabWideTensors(VOCAB) as fused_route:
        for step in range(STEPS):
            optimizer.zero_grad()
            loss = _fused_loss(student, teachers, batches[step % 2], "jsd")
            _backward(student, loss)
            assert optimizer.step()[0], "Megatron's optimizer skipped the step"
            losses.append(float(loss))
    # only logits tiles of CHUNK_ROWS rows, forward and backward: never a [T, V] tensor
    assert fused_route.largest_shape == (CHUNK_ROWS, VOCAB), fused_route.largest_shape
    assert all(torch.isfinite(torch.tensor(losses))), losses
    # the student moves towards the teachers' mixture, on both batches (jsd is bounded by
    # log 2 and falls more slowly than a KL: 8 steps take it ~40 % down)
    assert losses[-1] < 0.75 * losses[0], losses
    assert losses[-2] < 0.75 * losses[1], losses

    for teacher, before in zip(teachers, teacher_weights_before):
        assert not isinstance(teacher, type(student)) and not teacher.training
        for param, old in zip(teacher.parameters(), before):
            assert not param.requires_grad and param.grad is None and torch.equal(param, old)
