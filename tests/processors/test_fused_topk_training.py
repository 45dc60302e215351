"""Top-k on-policy distillation through the output processors only: a real GPTModel student in
real megatron-core DDP with Megatron's optimizer, two inference-only GPT teachers scoring the
student's ids (passed through `output_processor_context`), the loss `topk_kl` over fused buckets.
No [T, V] logits tensor is ever created, in forward or backward (`testing.vocab_watch`, a dispatch
mode over every op; the same watch does see the logits route's [T, V] tensors), one step's fused loss
and gradients equal `topk_opd_loss` on the logits, and the loss falls."""
from __future__ import annotations

import pytest
import torch

import megatron_rl_patches
from megatron_rl_patches import build_inference_model, topk_kl, topk_logprobs, topk_opd_loss, topk_output_processor
from megatron_rl_patches.testing.vocab_watch import VocabWideTensors

pytestmark = pytest.mark.megatron

VOCAB = 100  # no other dimension of these models is 100: a last dim of this size is a vocabulary dim
BATCH, SEQ = 8, 16
ROWS = BATCH * SEQ  # T
K = 8
CHUNK_ROWS = 16  # the fused ops' row tiles: [16, V] logits at most, never [T, V]
TEACHER_WEIGHTS = [0.7, 0.3]
STEPS = 8


def _student(kit):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = kit.config(init_method_std=0.3)
    ddp = kit.ddp(kit.gpt(config, vocab_size=VOCAB, seq_length=SEQ, seed=0), overlap_grad_reduce=True)
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, clip_grad=0.0), [ddp])
    return ddp, optimizer


def _teachers(kit):
    """Wider than the student, with sharp opinions of their own (std 0.3): inference-only builds."""
    config = kit.config(hidden_size=64, init_method_std=0.3)
    return [build_inference_model(kit.provider(config, vocab_size=VOCAB, seq_length=SEQ, seed=1 + j))[0]
            for j in range(len(TEACHER_WEIGHTS))]


def _args(batch):
    return batch["tokens"], batch["position_ids"], batch["attention_mask"]


def _fused_loss(student, teachers, batch) -> torch.Tensor:
    out = student(*_args(batch), output_processor=topk_output_processor(k=K, chunk_size=CHUNK_ROWS))
    with torch.no_grad():
        scored = [t(*_args(batch), output_processor=topk_output_processor(chunk_size=CHUNK_ROWS),
                    output_processor_context={"ids": out["topk_ids"]}) for t in teachers]
    return topk_kl(out["topk_log_probs"], out["tail"], torch.stack([s["topk_log_probs"] for s in scored]),
                   torch.stack([s["tail"] for s in scored]), teacher_weights=TEACHER_WEIGHTS).mean(), out["topk_ids"]


def _logits_loss(student, teachers, batch, ids) -> torch.Tensor:
    logits = student(*_args(batch))  # [b, s, V] through the output layer
    with torch.no_grad():
        buckets = [topk_logprobs(t(*_args(batch)), ids) for t in teachers]
    return topk_opd_loss(logits, ids, torch.stack([lp for lp, _ in buckets]), torch.stack([tl for _, tl in buckets]),
                         teacher_weights=TEACHER_WEIGHTS).mean()


def _backward(ddp, loss) -> torch.Tensor:
    ddp.zero_grad_buffer()
    loss.backward()
    ddp.finish_grad_sync()
    return torch.cat([p.main_grad.reshape(-1).clone() for p in ddp.parameters()])


def test_two_teacher_topk_distillation_without_logits(megatron_cpu, clean_patch_state):
    megatron_rl_patches.apply(only="gpt_output_processor")  # `native` on megatron-core >= 0.18
    student, optimizer = _student(megatron_cpu)
    teachers = _teachers(megatron_cpu)
    teacher_weights_before = [[p.clone() for p in t.parameters()] for t in teachers]
    batches = [megatron_cpu.batch(BATCH, SEQ, VOCAB, seed=s) for s in range(2)]

    # One step's fused loss and gradients equal the logits route on the same model outputs.
    fused, ids = _fused_loss(student, teachers, batches[0])
    fused_grads = _backward(student, fused)
    with VocabWideTensors(VOCAB) as logits_route:
        reference = _logits_loss(student, teachers, batches[0], ids)
        reference_grads = _backward(student, reference)
    assert logits_route.largest_bytes >= ROWS * VOCAB * 4, "the watch must see the logits route's [T, V] tensors"
    assert float(fused) == pytest.approx(float(reference), rel=1e-6, abs=1e-7)
    scale = float(reference_grads.abs().max())
    assert scale > 0 and float((fused_grads - reference_grads).abs().max()) <= 1e-5 * scale

    losses = []
    with VocabWideTensors(VOCAB) as fused_route:
        for step in range(STEPS):
            optimizer.zero_grad()
            loss, _ = _fused_loss(student, teachers, batches[step % 2])
            _backward(student, loss)
            assert optimizer.step()[0], "Megatron's optimizer skipped the step"
            losses.append(float(loss))
    # only logits tiles of CHUNK_ROWS rows, forward and backward: never a [T, V] tensor
    assert fused_route.largest_shape == (CHUNK_ROWS, VOCAB), fused_route.largest_shape
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert losses[-1] < 0.5 * losses[0], losses  # the student moves towards the teachers' mixture
    assert losses[-2] < 0.5 * losses[1], losses  # on both batches

    for teacher, before in zip(teachers, teacher_weights_before):
        assert not isinstance(teacher, type(student)) and not teacher.training
        for param, old in zip(teacher.parameters(), before):
            assert not param.requires_grad and param.grad is None and torch.equal(param, old)
