"""verl's live self-teacher (MEGATRON_RL_PATCHES_VERL_TEACHER=`student;context=KEY`) on verl 0.9.1's
real engine `forward_step` and its top-k distillation loss (`distillation_ppo_loss` as the logits
processor, `forward_kl_topk`, no policy loss), one 2-rank world: TP=1, then TP=2 with sequence
parallelism. The teacher's rows come from a no-grad pass of the student's own model over each
sample's context (the non-tensor field `hint`) + response. Against the package's float64 build of
the same GPTModel (the lane has no transformers family of it) on the privileged sequence: the
teacher's top-k log-probs (ids: the float64 top-k), the per-token KL, verl's loss and the student's
gradients with the teacher's terms detached. Controls: the teacher's rows against float64 scored
without the context (the student's own sequence) and with the context shifted by one token. A
missing field on rank 1 only: the same ValueError on both ranks, before the pass. The weights:
verl's old-log-prob pass (its real `forward_step`, no loss, no grad) then changed weights then the
update micro-batch: its rows are the float64 teacher's of the OLD weights (not the new ones'), read
back with no pass of their own; where one rank lacks the kept rows, both score with the new ones;
a log-prob pass whose micro-batch lacks the field on rank 1 only keeps no rows on either rank."""
from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("verl.models", reason="verl is not installed: run `make test-verl` (the verl lane)")
pytestmark = [pytest.mark.verl, pytest.mark.multirank]

import verl.models.mcore.registry  # noqa: E402,F401  (bound by name before any patch: see verl_kit)
import verl_kit as kit  # noqa: E402

from megatron_rl_patches.integrations.verl.old_rows import old_rows_of  # noqa: E402
from megatron_rl_patches.testing.multirank import run_multirank  # noqa: E402

VARIABLE = "MEGATRON_RL_PATCHES_VERL_TEACHER"
KEY, TOPK, TEMPERATURE = "hint", 8, 0.7
PROMPTS, RESPONSES = kit.PROMPTS, kit.RESPONSES
CONTEXTS = ([7, 300, 41, 9, 128, 77, 5], [250, 3, 499])  # the privileged ids, one list per sample
LAYOUTS = [{"name": "tp1", "tp": 1, "sp": False}, {"name": "tp2-sp", "tp": 2, "sp": True}]
TOL = 2e-5  # float32 against float64, relative to the largest value


def step(model, contexts, placeholder: bool = False, eng=None):
    """verl's engine step (on `eng`, default a new one) on a top-k distillation micro-batch with
    `contexts` under KEY (None: no field): the teacher rows its loss read, the per-token KL, the
    loss, the gradients."""
    from verl.trainer.distillation import distillation_ppo_loss
    from verl.utils import tensordict_utils as tu

    batch = kit.rl_batch(PROMPTS, RESPONSES, temperature=TEMPERATURE, distillation_use_topk=True,
                         distillation_only=True)
    if contexts is not None:
        tu.assign_non_tensor_stack(batch, KEY, [list(c) for c in contexts])
    if placeholder:  # what the agent loop stores for this teacher: zeros of verl's layout, K wide
        lengths = [p + r for p, r in zip(PROMPTS, RESPONSES)]
        batch["teacher_ids"] = kit.nested([torch.zeros(n, TOPK, dtype=torch.int32) for n in lengths])
        batch["teacher_logprobs"] = kit.nested([torch.zeros(n, TOPK) for n in lengths])
    config = kit.distillation_config(TOPK, clamp=None, use_task_rewards=False, use_policy_gradient=False,
                                     loss_max_clamp=None)
    seen = {}

    def seeing(**call):  # verl's loss, noting the micro-batch its logits processor reads
        if call.get("student_logits") is not None:
            seen["data"] = call["data"]
        return distillation_ppo_loss(**call)

    # bound as verl binds its loss (the route reads K from the partial's distillation_config)
    loss_function = functools.partial(seeing, config=kit.actor_config(), distillation_config=config)
    output, loss = kit.train_step(eng or kit.engine(False), model, batch, loss_function, loss_function)
    loss.backward()
    reduce_sequence_parallel_grads(model)
    data = seen["data"]
    rows = [(ids[p - 1:p - 1 + r].long(), values[p - 1:p - 1 + r].double()) for ids, values, p, r in
            zip(data["teacher_ids"].unbind(), data["teacher_logprobs"].unbind(), PROMPTS, RESPONSES)]
    return rows, kit.response_rows(output["distillation_losses"].detach(), PROMPTS), float(loss), kit.grads(model)


def reduce_sequence_parallel_grads(model) -> None:
    """Megatron's finalize_model_grads under sequence parallelism: the gradients of the parameters
    every TP rank holds whole summed over the TP group."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    if dist.get_world_size(group) > 1:
        for param in model.parameters():
            if getattr(param, "sequence_parallel", False) and param.grad is not None:
                dist.all_reduce(param.grad, group=group)


def float64_log_probs(reference, sequence: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """[n, V] float64 log-probs of the float64 model on one sequence (gathered over TP)."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    n = sequence.numel()
    causal = torch.ones(n, n, dtype=torch.bool).tril().logical_not()[None, None]
    logits = gather_from_tensor_model_parallel_region(reference(sequence[None], torch.arange(n)[None], causal))
    return torch.log_softmax(logits[0, :, :kit.VOCAB] / temperature, -1)


def teacher_reference(reference, contexts) -> list[torch.Tensor]:
    """Per sample, the float64 teacher's log-probs [R, V] on context + response (no grad)."""
    batch = kit.rl_batch(PROMPTS, RESPONSES, temperature=TEMPERATURE)
    out = []
    with torch.no_grad():
        for sequence, context, p in zip(batch["input_ids"].unbind(), contexts, PROMPTS):
            context = torch.as_tensor(context, dtype=torch.long)
            privileged = torch.cat([context, sequence[p:]])
            out.append(float64_log_probs(reference, privileged)[len(context) - 1:-1])
    return out


def float64_step(model, build, rows) -> tuple[list, list, float, dict]:
    """The float64 references: the teacher's log-probs on context + response; the (k+1)-bucket
    forward KL of the float64 student (at verl's temperature) against them (detached, at the ids
    the route chose), verl's token mean, and its gradients; the two controls' teacher log-probs."""
    reference = build(sequence_parallel=False)
    reference.load_state_dict(model.state_dict())
    reference.double()
    teacher = teacher_reference(reference, CONTEXTS)
    no_context = [torch.tensor(kit.rl_batch(PROMPTS, RESPONSES)["input_ids"].unbind()[i][:p].tolist())
                  for i, p in enumerate(PROMPTS)]
    controls = {"no_context": teacher_reference(reference, no_context),
                "shifted": teacher_reference(reference, [c[1:] + c[:1] for c in CONTEXTS])}
    batch = kit.rl_batch(PROMPTS, RESPONSES, temperature=TEMPERATURE)
    kl = []
    for sequence, (ids, _), q_all, p in zip(batch["input_ids"].unbind(), rows, teacher, PROMPTS):
        q = q_all.gather(1, ids)
        student = float64_log_probs(reference, sequence, TEMPERATURE)[p - 1:-1].gather(1, ids)
        q_tail, p_tail = torch.log1p(-q.exp().sum(-1)), torch.log1p(-student.exp().sum(-1))
        kl.append((q.exp() * (q - student)).sum(-1) + q_tail.exp() * (q_tail - p_tail))
    loss = torch.cat(kl).sum() / sum(RESPONSES)
    loss.backward()
    return teacher, [k.detach() for k in kl], float(loss), kit.grads(reference), controls


def log_prob_pass(model, eng, with_field: bool = True) -> None:
    """verl's old-log-prob pass on the rollout's micro-batch: its real `forward_step` (on the engine
    `eng`, which keeps the rows) with no loss, under no grad, with the entropy verl's trainer asks
    for there; the agent loop's placeholder rows (`with_field`: the contexts' field too)."""
    from verl.utils import tensordict_utils as tu

    batch = kit.rl_batch(PROMPTS, RESPONSES, temperature=TEMPERATURE, calculate_entropy=True)
    if with_field:
        tu.assign_non_tensor_stack(batch, KEY, [list(c) for c in CONTEXTS])
    lengths = [p + r for p, r in zip(PROMPTS, RESPONSES)]
    batch["teacher_ids"] = kit.nested([torch.zeros(n, TOPK, dtype=torch.int32) for n in lengths])
    batch["teacher_logprobs"] = kit.nested([torch.zeros(n, TOPK) for n in lengths])
    with torch.no_grad():
        kit.forward_step(eng, model, batch)


def old_weights_checks(model, build, rank: int, split: bool) -> dict:
    """The log-prob pass, the weights changed (scaled, as an optimizer step would move them), then the
    update micro-batch: its rows against the float64 teacher of the old and of the new weights, and
    the model's forwards in the update (1: the student's own, no teacher pass); both passes on one
    engine, as verl's actor runs them. `split`: again with the kept rows forgotten on rank 1 only:
    both ranks score now, with the new weights. Weights restored."""
    saved = [param.detach().clone() for param in model.parameters()]

    def float64_teacher():
        reference = build(sequence_parallel=False)
        reference.load_state_dict(model.state_dict())
        return teacher_reference(reference.double(), CONTEXTS)

    eng = kit.engine(False)
    log_prob_pass(model, eng)
    old = float64_teacher()
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(1.25)
    new = float64_teacher()
    forwards = []
    hook = model.register_forward_hook(lambda *_: forwards.append(1))
    try:
        rows = step(model, CONTEXTS, placeholder=True, eng=eng)[0]
        out = {"old_err": terms_error(rows, old), "new_err": terms_error(rows, new), "update_forwards": len(forwards)}
        if split:
            with torch.no_grad():
                for param, value in zip(model.parameters(), saved):
                    param.copy_(value)
            log_prob_pass(model, eng)
            with torch.no_grad():
                for param in model.parameters():
                    param.mul_(1.25)
            if rank == 1:
                old_rows_of(eng).forget()
            rows = step(model, CONTEXTS, placeholder=True, eng=eng)[0]
            out.update(split_old_err=terms_error(rows, old), split_new_err=terms_error(rows, new))
            # the log-prob pass's micro-batch without the field on rank 1 only: no rank scores it there
            # (rank 0 alone would run the pass's collectives against rank 1's forward)
            lone = kit.engine(False)
            log_prob_pass(model, lone, with_field=rank == 0)
            out["kept_without_field_on_one_rank"] = len(old_rows_of(lone).rows)
    finally:
        hook.remove()
        with torch.no_grad():
            for param, value in zip(model.parameters(), saved):
                param.copy_(value)
        model.zero_grad()
    return out


def terms_error(rows, teacher) -> float:
    return max(kit.relative(values, want.gather(1, ids)) for (ids, values), want in zip(rows, teacher))


def self_teacher_world(rank: int, world: int) -> list:
    import megatron_rl_patches
    from megatron_rl_patches.testing.megatron_cpu import megatron_on_cpu
    from megatron_rl_patches.testing.packed_gpt import build_packed_gpt

    results = []
    for layout in LAYOUTS:
        with megatron_on_cpu(tensor_parallel=layout["tp"]):
            extra = dict(tensor_model_parallel_size=2, sequence_parallel=layout["sp"]) if layout["tp"] > 1 else {}
            # init std 0.3: distributions far from uniform, so the KL is not a float32 rounding residue
            build = functools.partial(build_packed_gpt, vocab_size=kit.VOCAB, seed=3, init_method_std=0.3, **extra)
            model = build()
            megatron_rl_patches.apply(only="verl_topk_kd")
            try:
                rows, kl, loss, grads = step(model, CONTEXTS, placeholder=layout["tp"] > 1)
                refusal = "not tried"
                if layout["tp"] > 1:  # rank 1's micro-batch lacks the field: the same refusal on every rank
                    try:
                        step(model, CONTEXTS if rank == 0 else None)
                        refusal = "no error"
                    except ValueError as refused:
                        refusal = str(refused)
                model.zero_grad()
                weights = old_weights_checks(model, build, rank, split=layout["tp"] > 1)
            finally:
                megatron_rl_patches.revert()
            teacher, ref_kl, ref_loss, ref_grads, controls = float64_step(model, build, rows)
            kth = [want.topk(TOPK).values[:, -1] for want in teacher]
            results.append({
                "layout": layout["name"], "loss": loss, "float64": ref_loss,
                "terms_err": terms_error(rows, teacher),
                "ids_are_topk": all(bool((want.gather(1, ids).min(-1).values >= k - 1e-6).all())
                                    for (ids, _), want, k in zip(rows, teacher, kth)),
                "kl_err": max(kit.relative(a, b) for a, b in zip(kl, ref_kl)),
                "grad_err": max(kit.relative(grads[name], ref_grads[name]) for name in ref_grads),
                "grads_compared": len(ref_grads),
                **{f"control_{name}": terms_error(rows, want) for name, want in controls.items()},
                "refusal": refusal, **weights,
            })
    return results


def test_verls_live_self_teacher_scores_the_privileged_sequence_exactly(monkeypatch):
    monkeypatch.setenv(VARIABLE, f"student;context={KEY}")
    results = run_multirank(self_teacher_world, 2, timeout=300)
    for rank, outs in enumerate(results):
        for out in outs:
            print(f"rank {rank}: {out}")
            assert out["terms_err"] <= TOL and out["ids_are_topk"], out
            assert abs(out["loss"] - out["float64"]) <= TOL * abs(out["float64"]), out
            assert out["kl_err"] <= TOL and out["grad_err"] <= TOL and out["grads_compared"] > 4, out
            assert out["control_no_context"] > kit.CONTROL and out["control_shifted"] > kit.CONTROL, out
            # the update's rows: the old-log-prob pass's, from the weights before the change
            assert out["old_err"] <= TOL and out["new_err"] > kit.CONTROL and out["update_forwards"] == 1, out
            if out["layout"] != "tp1":  # rank 1's missing field, raised on both ranks by name
                assert f"no non-tensor field {KEY!r}" in out["refusal"], out
                assert "refused on rank(s) [1]" in out["refusal"], out
                # rank 1 without the kept rows: both ranks score now, with the new weights (no hang)
                assert out["split_new_err"] <= TOL and out["split_old_err"] > kit.CONTROL, out
                assert out["kept_without_field_on_one_rank"] == 0, out
    assert [out["layout"] for out in results[0]] == [layout["name"] for layout in LAYOUTS]


def test_verls_agent_loop_asks_nobody_for_the_live_self_teacher(verl_cpu, monkeypatch):
    """verl's agent-loop worker and teacher client (real, from verl's generated config; no replica
    behind it): zero rows of verl's layout, K wide, which the trainer's micro-batch replaces."""
    from test_verl_served import agent_loop_rows, manager

    import megatron_rl_patches

    monkeypatch.setenv(VARIABLE, f"student;context={KEY}")
    megatron_rl_patches.apply(only="verl_topk_kd")
    ids, log_probs = agent_loop_rows(manager(topk=TOPK), [5, 9, 200], [44, 310, 7, 2], fields={KEY: [3, 4]})
    assert ids.shape == log_probs.shape == (7, TOPK) and not ids.any() and not log_probs.any()


def test_verls_fused_route_is_refused_by_name_before_the_pass(verl_cpu):
    """verl's fused forward calls no logits processor: nothing would read the teacher's rows."""
    from verl.utils import tensordict_utils as tu

    from megatron_rl_patches.integrations.verl.self_teacher import self_taught
    from megatron_rl_patches.testing.packed_gpt import build_packed_gpt

    batch = kit.rl_batch(PROMPTS, RESPONSES, distillation_use_topk=True)
    tu.assign_non_tensor_stack(batch, KEY, [list(c) for c in CONTEXTS])
    calls = []
    model = build_packed_gpt(vocab_size=kit.VOCAB, seed=3)
    model.register_forward_hook(lambda *_: calls.append(1))
    with pytest.raises(ValueError, match=r"fused route \(use_fused_kernels\).*use_fused_kernels=False"):
        self_taught(batch, model, kit.engine(True), None, (KEY, None))
    assert not calls and "teacher_ids" not in batch.keys()
