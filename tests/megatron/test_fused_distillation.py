"""Top-k on-policy distillation with no logits anywhere: a real tiny GPT student in megatron-core
DDP and two inference-only GPT teachers, trained a few steps through the output processors and
`topk_kl` only. The loss falls, one step equals the logits route, and no [T, V] tensor is ever
allocated (a dispatch-mode watch over every op of the forwards and the backward)."""
from __future__ import annotations

import pytest
import torch

import megatron_rl_patches
from megatron_rl_patches import (
    build_inference_model,
    topk_kl,
    topk_logprobs,
    topk_opd_loss,
    topk_output_processor,
)
from megatron_rl_patches.testing import megatron_cpu as kit
from megatron_rl_patches.testing.vocab_watch import VocabWideTensors

pytestmark = pytest.mark.megatron
VOCAB, SEQ, BATCH, K, TILE_ROWS = 64, 16, 4, 6, 8


def _models():
    student = [kit.wrap_ddp(kit.build_tiny_gpt(vocab_size=VOCAB, seq_length=SEQ, seed=0))]
    sharp = kit.tiny_gpt_config(init_method_std=0.3)  # peaked teachers, far from the fresh student
    teachers = [build_inference_model(kit.tiny_gpt_provider(sharp, vocab_size=VOCAB, seq_length=SEQ, seed=10 + j))[0]
                for j in range(2)]
    return student, teachers


def _forward(model, batch, processor, ids=None):
    return model(batch["tokens"], batch["position_ids"], batch["attention_mask"], output_processor=processor,
                 output_processor_context=None if ids is None else {"ids": ids})


@torch.no_grad()
def _teacher_buckets(teachers, batch):
    """The first teacher picks its top-k ids; both score them: [2, T, k] log-probs, [2, T] tails."""
    first = _forward(teachers[0], batch, topk_output_processor(k=K, chunk_size=TILE_ROWS))
    second = _forward(teachers[1], batch, topk_output_processor(chunk_size=TILE_ROWS), first["topk_ids"])
    lp = torch.stack([out["topk_log_probs"].reshape(-1, K) for out in (first, second)])
    tail = torch.stack([out["tail"].reshape(-1) for out in (first, second)])
    return first["topk_ids"], lp, tail


def _student_kl(student, batch, ids, teacher_lp, teacher_tail):
    out = _forward(student[0], batch, topk_output_processor(chunk_size=TILE_ROWS), ids)
    return topk_kl(out["topk_log_probs"].reshape(-1, K), out["tail"].reshape(-1), teacher_lp, teacher_tail).mean()


def test_student_and_two_teachers_distil_through_processors_only(megatron_cpu, clean_patch_state):
    megatron_rl_patches.apply(only="gpt_output_processor")  # `native` on megatron-core >= 0.18
    student, teachers = _models()
    batch = kit.make_batch(BATCH, SEQ, VOCAB, seed=3)
    tokens = BATCH * SEQ
    losses = []
    with VocabWideTensors(VOCAB) as watch:
        for _ in range(8):
            student[0].zero_grad_buffer()
            ids, teacher_lp, teacher_tail = _teacher_buckets(teachers, batch)
            loss = _student_kl(student, batch, ids, teacher_lp, teacher_tail)
            loss.backward()
            student[0].finish_grad_sync()
            kit.sgd_step(student, lr=2.0)
            losses.append(float(loss))
    assert losses[-1] < 0.6 * losses[0], losses
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    # only logits tiles of TILE_ROWS rows: never the [T, V] logits of any of the three models
    assert watch.largest_shape == (TILE_ROWS, VOCAB), watch.largest_shape
    assert watch.largest_bytes < tokens * VOCAB * 4
    for teacher in teachers:  # inference-only: nothing accumulated a gradient
        assert all(p.grad is None and getattr(p, "main_grad", None) is None for p in teacher.parameters())


def test_one_fused_step_equals_the_logits_route(megatron_cpu, clean_patch_state):
    megatron_rl_patches.apply(only="gpt_output_processor")
    student, teachers = _models()
    batch = kit.make_batch(BATCH, SEQ, VOCAB, seed=5)
    ids, teacher_lp, teacher_tail = _teacher_buckets(teachers, batch)
    with torch.no_grad():  # the same buckets from the teachers' full logits
        for j, teacher in enumerate(teachers):
            lp, tail = topk_logprobs(kit.gpt_forward(teacher, batch).reshape(-1, VOCAB), ids.reshape(-1, K))
            torch.testing.assert_close(teacher_lp[j], lp, rtol=2e-6, atol=2e-6)
            torch.testing.assert_close(teacher_tail[j], tail, rtol=2e-6, atol=2e-6)

    fused = _student_kl(student, batch, ids, teacher_lp, teacher_tail)
    fused.backward()
    fused_grads = {n: p.main_grad.clone() for n, p in student[0].named_parameters()}
    student[0].zero_grad_buffer()
    logits = kit.gpt_forward(student[0], batch).reshape(-1, VOCAB)
    reference = topk_opd_loss(logits, ids.reshape(-1, K), teacher_lp, teacher_tail).mean()
    reference.backward()
    torch.testing.assert_close(fused, reference, rtol=1e-6, atol=1e-7)
    for name, param in student[0].named_parameters():
        torch.testing.assert_close(fused_grads[name], param.main_grad, rtol=1e-5, atol=1e-7, msg=name)
