"""In-process teachers with a privileged context in slime_opd through slime 624b824a's real
`MegatronTrainRayActor.train_actor` at one rank: a snapshot teacher (`teacher-a;context=hint`, a
checkpoint of the actor's architecture kept as a host snapshot) and the live self-teacher
(`student;context=hint`: the actor's current weights, before the rollout's first optimizer step,
in a no-grad pass of slime's forward_only) each scoring sample i's train_metadata["hint"] + the
student's response. Their log-probs at the step's ids, the first step's OPD loss and every gradient
against dense float64 on the privileged sequences (the teachers' terms detached: no gradient flows
through the live teacher's pass); negative controls: each teacher scored without its context, and
with the context shifted by one token, miss by far more."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.slime
HINTS = (5, 9, 4, 7)  # context lengths of the kit's 4 samples
WEIGHTS = (0.3, 0.7)  # slime_ranks.OPD_ENV's: the snapshot, the live self-teacher


def hints(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in HINTS]


def privileged(data: dict, contexts: list[list[int]]) -> dict:
    """The rollout's samples as the teacher sees them: context + the student's response."""
    tokens = [torch.cat([torch.tensor(c), t[len(t) - r:]]) for c, t, r in
              zip(contexts, data["tokens"], data["response_lengths"])]
    return {**data, "tokens": tokens}


# name -> (pipeline stages, tensor-parallel size, slime's extra flags)
LAYOUTS = {"1rank": (1, 1, ()), "pp2": (2, 1, ()), "tp2sp": (1, 2, ("--sequence-parallel",))}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_snapshot_and_live_self_teacher_with_a_context_equal_dense_float64(slime_cpu, layout):
    import slime_kit as kit
    import slime_ranks

    from megatron_rl_patches.testing.multirank import run_multirank

    pipeline, tensor, flags = LAYOUTS[layout]
    contexts = hints(kit.VOCAB)
    env = {"TEACHERS": "teacher-a;context=hint,student;context=hint"}
    ranks = run_multirank(slime_ranks.opd_train_actor, pipeline * tensor, pipeline, 1, tensor, None, None, flags, 1,
                          None, 1, None, None, None, env, [{"hint": c} for c in contexts], timeout=400)
    assert all(r["active"] == "actor" for r in ranks)

    def whole(field, tag=None):
        parts = [r[field] if tag is None else r[field][tag] for r in ranks]
        return kit.unsplit(parts, ranks[0]["split"]) if tensor > 1 else kit.whole_stages(parts)

    rank = {**ranks[-1], "grads": whole("grads")}
    t = slime_ranks.TEMPERATURE
    with kit.slime_session("--loss-type", "custom_loss", "--custom-loss-function-path", slime_ranks.OPD_LOSS) as args:
        names = [name for name, _ in kit.provider_func(args)().named_parameters()]
        states = {tag: whole("states", tag) for tag in ranks[0]["states"]}
        data, ids = kit.rollout(0), rank["ids"]
        student = kit.float64_copy(args, [states["actor"][name] for name in names])
        with torch.no_grad():
            snapshot = kit.float64_copy(args, [states["opd_teacher_0"][name] for name in names])
            live = kit.float64_copy(args, [states["actor"][name] for name in names])  # the same weights, no grad

            def seen(contexts_of):
                rollout = data if contexts_of is None else privileged(data, contexts_of)
                return [kit.response_logps(module, rollout, t) for module in (snapshot, live)]

            teachers = seen(contexts)
            without = seen(None)
            shifted = seen([c[1:] + [(c[0] + 1) % kit.VOCAB] for c in contexts])
        expected = kit.dense_opd_loss(kit.response_logps(student, data, t), teachers, data, ids, WEIGHTS)
        expected.backward()
    got = rank["teacher_logprobs"]  # per sample [2, R, k]

    def miss(reference, teacher):
        return max((g[teacher].double() - r.gather(-1, i)).abs().max().item()
                   for g, r, i in zip(got, reference[teacher], ids))

    errors = {name: [miss(reference, teacher) for teacher in (0, 1)]
              for name, reference in (("context", teachers), ("without", without), ("shifted", shifted))}
    (losses,) = rank["losses"]
    loss_error = abs(float(losses["opd_topk_loss"]) - float(expected))
    grads = rank["grads"]
    grad_error = max((grads[name].double() - p.grad).abs().max().item() for name, p in student.named_parameters())
    print(f"slime_opd train_actor {layout}, snapshot / live self-teacher with a context vs dense float64: "
          f"log-probs at the ids |Δ| {errors['context'][0]:.2e} / {errors['context'][1]:.2e} (without the context "
          f"{errors['without'][0]:.2e} / {errors['without'][1]:.2e}, shifted by one {errors['shifted'][0]:.2e} / "
          f"{errors['shifted'][1]:.2e}); loss {float(expected):.6f} |Δloss| {loss_error:.2e}, max |Δgrad| "
          f"{grad_error:.2e}")
    for teacher in (0, 1):
        assert errors["context"][teacher] <= 1e-4  # float32 passes: log-probs near -10 at the tail ids
        floor = 1000 * max(errors["context"][teacher], 1e-6)  # the negative controls: 1000x the error at least
        assert min(errors["without"][teacher], errors["shifted"][teacher]) > floor
    assert loss_error <= 1e-5 * max(1.0, abs(float(expected)))
    for name, p in student.named_parameters():
        torch.testing.assert_close(grads[name].double(), p.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_a_hugging_face_teacher_with_a_context_beside_a_snapshot_without_equals_dense_float64(slime_cpu, tmp_path):
    """A Hugging Face directory of another size (a Qwen3, hidden 48, 4 layers; built as a separate
    inference-only model) with `;context=hint` beside the snapshot `teacher-a` without one."""
    import slime_kit as kit
    import slime_ranks

    from megatron_rl_patches.testing.hf_checkpoints import tiny_hf_config, transformers_layout, write_tiny_checkpoint
    from megatron_rl_patches.testing.multirank import run_multirank

    path = str(tmp_path / "qwen3")
    other = dict(hidden_size=48, num_hidden_layers=4, intermediate_size=64, vocab_size=64, max_position_embeddings=64)
    write_tiny_checkpoint(path, transformers_layout(tiny_hf_config("qwen3", **other)), seed=12)
    contexts = hints(kit.VOCAB)
    env = {"TEACHERS": f"teacher-a,{path};context=hint"}
    (rank,) = run_multirank(slime_ranks.opd_train_actor, 1, 1, 1, 1, None, path, (), 1, None, 1, None, None, None,
                            env, [{"hint": c} for c in contexts], timeout=400)
    t = slime_ranks.TEMPERATURE
    with kit.slime_session("--loss-type", "custom_loss", "--custom-loss-function-path", slime_ranks.OPD_LOSS) as args:
        data, ids = kit.rollout(0), rank["ids"]
        student, snapshot = kit.student_and_snapshot(args, rank["states"], data, t)
        hf = {name: kit.hf_teacher_logps(path, rollout, t, kit.VOCAB) for name, rollout in
              (("context", privileged(data, contexts)), ("without", data),
               ("shifted", privileged(data, [c[1:] + [(c[0] + 1) % kit.VOCAB] for c in contexts])))}
        expected = kit.dense_opd_loss(kit.response_logps(student, data, t), [snapshot, hf["context"]], data, ids,
                                      WEIGHTS)
        expected.backward()
    got = rank["teacher_logprobs"]
    errors = {name: max((g[1].double() - r.gather(-1, i)).abs().max().item() for g, r, i in zip(got, reference, ids))
              for name, reference in hf.items()}
    (losses,) = rank["losses"]
    loss_error = abs(float(losses["opd_topk_loss"]) - float(expected))
    grads = rank["grads"]
    grad_error = max((grads[name].double() - p.grad).abs().max().item() for name, p in student.named_parameters())
    print(f"slime_opd train_actor, a Hugging Face teacher with a context vs dense float64: log-probs at the ids "
          f"|Δ| {errors['context']:.2e} (without the context {errors['without']:.2e}, shifted by one "
          f"{errors['shifted']:.2e}); loss {float(expected):.6f} |Δloss| {loss_error:.2e}, max |Δgrad| "
          f"{grad_error:.2e}")
    assert errors["context"] <= 1e-4
    assert min(errors["without"], errors["shifted"]) > 1000 * max(errors["context"], 1e-6)
    assert loss_error <= 1e-5 * max(1.0, abs(float(expected)))
    for name, p in student.named_parameters():
        torch.testing.assert_close(grads[name].double(), p.grad, rtol=1e-4, atol=1e-6, msg=name)
