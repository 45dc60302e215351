"""`verl_topk_kd` on verl 0.9.1's real top-k distillation code: `compute_forward_kl_topk` (its
Megatron losses, called where verl's `compute_topk_loss` looks it up) and its registered
`forward_kl_topk` loss (the zero clamp)."""
from __future__ import annotations

import logging

import pytest
import torch

pytest.importorskip("verl.models", reason="verl is not installed: run `make test-verl` (the verl lane)")
pytestmark = pytest.mark.verl

import verl.trainer.distillation.losses as verl_losses  # noqa: E402
import verl.trainer.distillation.megatron.losses as megatron_losses  # noqa: E402
from verl_kit import distillation_config, nested  # noqa: E402

import megatron_rl_patches  # noqa: E402
from megatron_rl_patches.integrations.verl.topk import KEYS, REPLACED, exact_forward_kl_topk  # noqa: E402
from megatron_rl_patches.testing.invariance import counting_invariant_calls  # noqa: E402

VOCAB, K, PROMPT, RESPONSE = 512, 16, 4, 10
LENGTHS = (PROMPT + RESPONSE, PROMPT + RESPONSE)


def _config(clamp=-10.0):
    return distillation_config(K, clamp)


def _inputs(sharper: float = 1.5, seed: int = 0):
    """Student logits [1, T, V] (a leaf) and the teacher's nested top-k (ids, log-probs). The
    student is the teacher, sharper: it puts more mass on the teacher's top-k than the teacher
    (Q ≈ 0.2 at k = 16), where verl's top-k sum is negative."""
    gen = torch.Generator().manual_seed(seed)
    teacher_logits = 1.5 * torch.randn(sum(LENGTHS), VOCAB, generator=gen)
    teacher = torch.log_softmax(teacher_logits, dim=-1).topk(K, dim=-1)
    student = (sharper * teacher_logits)[None].clone().requires_grad_(True)
    split = list(torch.split(torch.arange(sum(LENGTHS)), LENGTHS))
    ids = nested([teacher.indices[rows] for rows in split])
    log_probs = nested([teacher.values[rows] for rows in split])
    return student, log_probs, ids, teacher_logits


def _float64_kl(student, teacher_logits, clamp=None):
    """The (k+1)-bucket forward KL in float64 from full logits."""
    log_p = torch.log_softmax(student.detach()[0].double(), dim=-1)
    teacher = torch.log_softmax(teacher_logits.double(), dim=-1).topk(K, dim=-1)
    q = teacher.values if clamp is None else teacher.values.clamp_min(clamp)
    p = log_p.gather(-1, teacher.indices)
    q_tail = torch.log1p(-q.exp().sum(-1))
    p_tail = torch.log1p(-p.exp().sum(-1))
    return (q.exp() * (q - p)).sum(-1) + q_tail.exp() * (q_tail - p_tail)


def _registered_loss(outputs):
    """verl's registered `forward_kl_topk` loss (with its clamp at 0) on verl's nested layout."""
    def split(value):  # [1, T] -> nested [b, j], keeping the autograd graph (nested_tensor copies)
        return torch.nested.as_nested_tensor(list(torch.split(value[0], LENGTHS)), layout=torch.jagged)

    model_output = {key: split(value) for key, value in outputs.items()}
    data = _data()
    losses, _ = verl_losses.compute_forward_kl_topk(config=None, distillation_config=_config(),
                                                    model_output=model_output, data=data)
    return losses


def _data():
    from verl.utils import tensordict_utils as tu

    return tu.get_tensordict({
        "prompts": nested([torch.zeros(PROMPT, dtype=torch.long)] * len(LENGTHS)),
        "responses": nested([torch.zeros(RESPONSE, dtype=torch.long)] * len(LENGTHS)),
        "response_mask": nested([torch.ones(RESPONSE)] * len(LENGTHS)),
    })


def _zero_gradient_tokens(student, log_probs, ids) -> tuple[int, int]:
    """(tokens whose student logits get no gradient from verl's registered loss, tokens scored)."""
    outputs = megatron_losses.compute_forward_kl_topk(student, log_probs, ids, _config(), "thd")
    loss = _registered_loss(outputs)
    student.grad = None
    loss.sum().backward()
    grad_rows = student.grad[0].abs().amax(dim=-1)
    scored = torch.cat([torch.arange(s + PROMPT - 1, s + PROMPT - 1 + RESPONSE)  # verl's left shift by one
                        for s in (0, LENGTHS[0])])
    return int((grad_rows[scored] == 0).sum()), scored.numel()


def test_verls_clamp_zeroes_the_gradient_and_the_patch_restores_it(verl_cpu, caplog):
    student, log_probs, ids, _ = _inputs()
    verl_zero, scored = _zero_gradient_tokens(student, log_probs, ids)
    raw = megatron_losses.compute_forward_kl_topk(student, log_probs, ids, _config(), "thd")
    assert (raw["distillation_losses"] < 0).all()  # verl's own sum is negative everywhere here
    megatron_rl_patches.apply(only="verl_topk_kd")
    with caplog.at_level(logging.WARNING, logger="megatron_rl_patches"):
        patched_zero, _ = _zero_gradient_tokens(student, log_probs, ids)
        _zero_gradient_tokens(student, log_probs, ids)
    print(f"zero-gradient tokens of {scored}: verl {verl_zero}, patched {patched_zero}")
    assert verl_zero == scored and patched_zero == 0
    assert sum(REPLACED in record.getMessage() for record in caplog.records) == 1  # logged once


def test_patched_loss_matches_float64_and_keeps_verls_keys_and_shapes(verl_cpu):
    student, log_probs, ids, teacher_logits = _inputs(sharper=1.2)
    original = megatron_losses.compute_forward_kl_topk(student, log_probs, ids, _config(), "thd")
    megatron_rl_patches.apply(only="verl_topk_kd")
    patched = megatron_losses.compute_forward_kl_topk(student, log_probs, ids, _config(), "thd")
    assert tuple(patched) == KEYS and set(original) == set(KEYS)
    for key in KEYS:
        assert patched[key].shape == original[key].shape == student.shape[:2], key
        assert patched[key].dtype == original[key].dtype, key
    error = (patched["distillation_losses"][0].double() - _float64_kl(student, teacher_logits, -10.0)).abs().max()
    print(f"exact top-k KL vs float64: {error.item():.2e}")
    assert error < 1e-5 and (patched["distillation_losses"] > 0).all()
    assert torch.allclose(patched["teacher_mass"], original["teacher_mass"])
    assert torch.equal(patched["overlap_count"], original["overlap_count"])
    assert torch.allclose(patched["overlap_token_advantage"], original["overlap_token_advantage"], atol=1e-5)
    # verl's student mass is the clamped one; both agree where no student log-prob is below -10
    assert torch.allclose(patched["student_mass"], original["student_mass"], atol=1e-4)


def test_log_prob_min_clamp_floors_the_teachers_log_probs(verl_cpu):
    student, log_probs, ids, teacher_logits = _inputs(sharper=1.0)
    megatron_rl_patches.apply(only="verl_topk_kd")
    clamp = -4.0
    out = megatron_losses.compute_forward_kl_topk(student, log_probs, ids, _config(clamp), "thd")
    want = _float64_kl(student, teacher_logits, clamp)
    assert (log_probs.values() < clamp).any()  # the clamp matters on these inputs
    assert (out["distillation_losses"][0].double() - want).abs().max() < 1e-5
    unclamped = megatron_losses.compute_forward_kl_topk(student, log_probs, ids, _config(None), "thd")
    assert not torch.allclose(unclamped["distillation_losses"], out["distillation_losses"])


def test_padded_all_zero_id_rows_give_zeros_and_leave_the_others_alone(verl_cpu):
    """verl pads TP/CP alignment rows with all-zero ids (repeated ids: our op would refuse them)."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(1, 6, VOCAB, generator=gen, requires_grad=True)
    teacher = torch.log_softmax(torch.randn(6, VOCAB, generator=gen), dim=-1).topk(K, dim=-1)
    ids, values = teacher.indices.clone(), teacher.values.clone()
    ids[4:], values[4:] = 0, 0.0
    out = exact_forward_kl_topk(logits, values[None], ids[None], -10.0)
    alone = exact_forward_kl_topk(logits[:, :4], values[None, :4], ids[None, :4], -10.0)
    for key in KEYS:
        assert torch.equal(out[key][0, 4:], torch.zeros_like(out[key][0, 4:])), key
        assert torch.allclose(out[key][0, :4].double(), alone[key][0].double()), key
    out["distillation_losses"].sum().backward()
    assert logits.grad[0, 4:].abs().max() == 0 and logits.grad[0, :4].abs().max() > 0


def test_disable_keeps_verls_loss(verl_cpu, monkeypatch):
    original = megatron_losses.compute_forward_kl_topk
    monkeypatch.setenv("MEGATRON_RL_PATCHES", "all")
    monkeypatch.setenv("MEGATRON_RL_PATCHES_DISABLE", "verl_topk_kd")
    megatron_rl_patches.apply()
    assert megatron_losses.compute_forward_kl_topk is original
    assert {s.status for s in megatron_rl_patches.applied() if s.name == "verl_topk_kd"} == {"skipped"}


def test_the_loss_inside_verls_engine_step_follows_the_students_batch_invariant_mode(verl_cpu, monkeypatch):
    """verl hands the loss no model config: the engine's forward_step (patched) resolves the
    student's mode from its model's config and its micro-batch carries it to verl's own
    `compute_topk_loss` (patched), whose loss runs in it (the invariant op's bits; the default
    mode runs no invariant code, counted on every CPU). verl's micro-batch is left as it was; a
    micro-batch no patched step handed over gets the setting's mode (unset: the default)."""
    import types

    from verl.utils import tensordict_utils as tu

    from megatron_rl_patches.integrations.verl.topk import MODE, forward_step_wrapper

    monkeypatch.delenv("MEGATRON_RL_PATCHES_INVARIANT", raising=False)
    gen = torch.Generator().manual_seed(5)
    student = (3 * torch.randn(1, sum(LENGTHS), 5000, generator=gen)).requires_grad_(True)
    teacher = torch.log_softmax(torch.randn(sum(LENGTHS), 5000, generator=gen), dim=-1).topk(K, dim=-1)
    split = list(torch.split(torch.arange(sum(LENGTHS)), LENGTHS))
    ids, log_probs = nested([teacher.indices[r] for r in split]), nested([teacher.values[r] for r in split])
    micro_batch = tu.get_tensordict({"teacher_logprobs": log_probs, "teacher_ids": ids})
    actor = types.SimpleNamespace(strategy="megatron")
    megatron_rl_patches.apply(only="verl_topk_kd")

    def forward_step(batch_iter, model):  # verl's engine step: the loss runs inside it on its micro-batch
        return verl_losses.compute_topk_loss(actor, _config(None), next(batch_iter), student, "thd")

    def student_of(on):
        return [types.SimpleNamespace(config=types.SimpleNamespace(batch_invariant_mode=on))]

    seen, calls = {}, {}
    for on in (True, False):
        with counting_invariant_calls() as calls[on]:
            seen[on] = forward_step_wrapper(forward_step, None, (iter([micro_batch]), student_of(on)), {})[
                "distillation_losses"]
    want = exact_forward_kl_topk(student, teacher.values[None], teacher.indices[None], None, invariant=True)
    assert torch.equal(seen[True], want["distillation_losses"])
    assert calls[True].count > 0 and calls[False].count == 0, calls
    assert MODE not in micro_batch.keys()  # the caller's micro-batch untouched
    unmarked = verl_losses.compute_topk_loss(actor, _config(None), micro_batch, student, "thd")
    assert torch.equal(unmarked["distillation_losses"], seen[False])
