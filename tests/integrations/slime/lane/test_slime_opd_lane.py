"""slime 624b824a's actor and train_one_step with top-k multi-teacher OPD (`slime_opd`)."""
from __future__ import annotations

import math

import pytest
import torch

pytestmark = pytest.mark.slime

import megatron_rl_patches  # noqa: E402

LOSS = "megatron_rl_patches.integrations.slime_opd.topk_opd_policy_loss"
TEMPERATURE = 0.8
WEIGHTS = (0.3, 0.7)
K = 4


def _opd_env(monkeypatch, **extra: str) -> None:
    values = {"TEACHERS": "teacher-a,teacher-b", "WEIGHTS": ",".join(map(str, WEIGHTS)), "K": str(K),
              "DIVERGENCE": "forward_kl", "POLICY_WEIGHT": "0", "COEF": "1", **extra}
    for name, value in values.items():
        monkeypatch.setenv(f"MEGATRON_RL_PATCHES_OPD_{name}", value)


def _union_as_float64_selects(kit, args, student_values, teacher_values, data, ids, masks) -> None:
    """Each row's union is the student's top-K (first) and the first teacher's, as float64 ranks them."""
    student = kit.response_logps(kit.float64_copy(args, student_values), data, TEMPERATURE)
    teacher = kit.response_logps(kit.float64_copy(args, teacher_values), data, TEMPERATURE)
    widened = 0
    for s_logp, t_logp, sample_ids, mask in zip(student, teacher, ids, masks, strict=True):
        own, theirs = s_logp.topk(K).indices, t_logp.topk(K).indices
        for row in range(sample_ids.shape[0]):
            assert set(sample_ids[row, :K].tolist()) == set(own[row].tolist())
            union = set(own[row].tolist()) | set(theirs[row].tolist())
            assert set(sample_ids[row][mask[row]].tolist()) == union and mask[row].sum() == len(union)
            widened += len(union) > K
    assert widened, "no row's union is wider than the student's ids: the test would not see a wrong union"


def _teacher_topk_as_float64_selects(kit, args, student_values, teacher_values, data, ids) -> None:
    """Each row's ids are the first teacher's top-K as float64 ranks them (IDS_FROM=teacher)."""
    student = kit.response_logps(kit.float64_copy(args, student_values), data, TEMPERATURE)
    teacher = kit.response_logps(kit.float64_copy(args, teacher_values), data, TEMPERATURE)
    moved = 0
    for s_logp, t_logp, sample_ids in zip(student, teacher, ids, strict=True):
        for row in range(sample_ids.shape[0]):
            assert set(sample_ids[row].tolist()) == set(t_logp[row].topk(K).indices.tolist())
            moved += set(sample_ids[row].tolist()) != set(s_logp[row].topk(K).indices.tolist())
    assert moved, "no row's teacher ids differ from the student's: the test would not see the student's ids"


@pytest.mark.parametrize("ids_from, step_route", [("student", "fused"), ("union", "fused"), ("student", "logits"),
                                                   ("union", "logits"), ("teacher", "fused")])
def test_topk_opd_two_teachers_first_step_equals_dense_float64(slime_cpu, monkeypatch, ids_from, step_route):
    """Teachers scored on the fused route; the training step on it, or on slime's logits path (as
    any fallback of slime_fused sends it: here a configuration the route is told it cannot serve)."""
    import slime_kit as kit
    import slime_standins
    from slime.backends.megatron_utils import model as slime_model

    from megatron_rl_patches.integrations.megatron.opd.opd_settings import opd_settings
    from megatron_rl_patches.integrations.slime import fused as slime_fused
    from megatron_rl_patches.integrations.slime import opd as slime_opd
    from megatron_rl_patches.testing.vocab_watch import VocabWideTensors

    slime_standins.cpu_pinned_memory(monkeypatch)
    _opd_env(monkeypatch, IDS_FROM=ids_from)
    width = 2 * K if ids_from == "union" else K
    megatron_rl_patches.apply(only=["slime_fused", "gpt_output_processor", "slime_opd"])
    with kit.slime_session("--loss-type", "custom_loss", "--custom-loss-function-path", LOSS,
                           rollout_temperature=TEMPERATURE, log_probs_chunk_size=4) as args:
        model, optimizer, scheduler = kit.build(args)
        actor = kit.actor(args, model, {"teacher-a": 1, "teacher-b": 2}, monkeypatch)
        setattr(actor, slime_opd.ATTRIBUTE, slime_opd.load_teachers(actor, opd_settings()))
        gpt = model[0].module
        snapshots = []
        for tag in ("opd_teacher_0", "opd_teacher_1"):
            actor._switch_model(tag)
            snapshots.append([p.detach().clone() for p in gpt.parameters()])
        actor._switch_model("actor")
        data = kit.rollout(0)
        old = kit.log_probs(args, model, data)
        data = kit.rollout(0, old["log_probs"])
        data["num_microbatches"] = [len(data["micro_batch_indices"])]
        with VocabWideTensors(vocab=kit.VOCAB) as scoring:
            slime_opd.score_teachers(actor, data, opd_settings())
        assert actor._active_model_tag == "actor"
        ids, masks = data[slime_opd.IDS], data.get(slime_opd.IDS_MASK)
        assert [tuple(i.shape) for i in ids] == [(r, width) for r in kit.RESPONSES]
        assert [tuple(t.shape) for t in data[slime_opd.TEACHER_LOGPROBS]] == [(2, r, width) for r in kit.RESPONSES]
        assert (masks is not None) == (ids_from == "union")
        if ids_from == "teacher":
            _teacher_topk_as_float64_selects(kit, args, [p.detach() for p in gpt.parameters()], snapshots[0], data,
                                             ids)
        if masks is not None:
            _union_as_float64_selects(kit, args, [p.detach() for p in gpt.parameters()], snapshots[0], data, ids,
                                      masks)
        expected, student = kit.dense_topk_opd(args, model, snapshots, data, ids, WEIGHTS, TEMPERATURE, masks)
        for chunk in model:
            chunk.train()
        grads: list[torch.Tensor] = []
        optimizer_step = optimizer.step

        def step_noting_grads(*a, **k):  # the reduced gradients, before the optimizer consumes them
            grads.extend(p.main_grad.clone() for p in gpt.parameters())
            return optimizer_step(*a, **k)

        monkeypatch.setattr(optimizer, "step", step_noting_grads)
        if step_route == "logits":
            monkeypatch.setattr(slime_fused, "unservable", lambda _: "a feature of this test's configuration")
        with VocabWideTensors(vocab=kit.VOCAB) as step:
            losses, _ = slime_model.train_one_step(args, 0, 0, kit.iterators(data), model, optimizer, scheduler, 2, 4)
    for watch in (scoring, step) if step_route == "fused" else (scoring,):  # nothing [T, V]: one tile at most
        assert math.prod(watch.largest_shape[:-1]) <= 4, watch.as_dict()
    if step_route == "logits":  # the step really ran on slime's logits: [T, V] of a micro-batch
        assert math.prod(step.largest_shape[:-1]) >= min(kit.PROMPTS) + min(kit.RESPONSES), step.as_dict()
    loss_error = abs(float(losses["opd_topk_loss"]) - float(expected))
    grad_error = max((g.double() - r.grad).abs().max().item() for g, r in zip(grads, student.parameters()))
    print(f"slime_opd ({ids_from} ids, {step_route} step) vs dense float64: loss {float(expected):.6f}, "
          f"|Δloss| {loss_error:.2e}, max |Δgrad| {grad_error:.2e}")
    assert loss_error <= 1e-5 * max(1.0, abs(float(expected)))
    for g, r in zip(grads, student.parameters()):
        torch.testing.assert_close(g.double(), r.grad, rtol=1e-4, atol=1e-6)
