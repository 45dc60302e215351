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

from megatron_rl_patches.testing.layouts import ALLGATHER_CP_ARGS as ALLGATHER_CP
from megatron_rl_patches.testing.layouts import NOPE_ARGS as NOPE

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


# name -> (pipeline stages, context-parallel size, tensor-parallel size, slime's extra flags, whether a Hugging
# Face teacher with the context scores beside them). At CP=2 (megatron-core's zigzag, and slime's
# --allgather-cp: contiguous slices on the model, per-sample fields in the zigzag rows) a rank holds
# other rows of a response in the privileged sequence than in the student's: the scores come back
# to the student's rows. (A Hugging Face teacher is refused with --allgather-cp, context or none.)
LAYOUTS = {"1rank": (1, 1, 1, (), False), "pp2": (2, 1, 1, (), False),
           "tp2sp": (1, 1, 2, ("--sequence-parallel",), False), "cp2": (1, 2, 1, (), True),
           "cp2ag": (1, 2, 1, ALLGATHER_CP, False)}
HF_WEIGHTS = (0.3, 0.5, 0.2)  # the snapshot, the live self-teacher, the Hugging Face teacher
# the layouts whose ids are the first (privileged) teacher's own top-k, moved back to the student's rows
TEACHER_IDS = ("cp2ag",)


def write_hf_teacher(path: str) -> None:
    """A Qwen3 of another size (hidden 48, 4 layers) than the actor, of its vocabulary."""
    from megatron_rl_patches.testing.hf_checkpoints import tiny_hf_config, transformers_layout, write_tiny_checkpoint

    other = dict(hidden_size=48, num_hidden_layers=4, intermediate_size=64, vocab_size=64, max_position_embeddings=64)
    write_tiny_checkpoint(path, transformers_layout(tiny_hf_config("qwen3", **other)), seed=12)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_snapshot_and_live_self_teacher_with_a_context_equal_dense_float64(slime_cpu, layout, tmp_path):
    import slime_kit as kit
    import slime_ranks

    from megatron_rl_patches.testing.multirank import run_multirank

    pipeline, context, tensor, flags, with_hf = LAYOUTS[layout]
    contexts = hints(kit.VOCAB)
    env = {"TEACHERS": "teacher-a;context=hint,student;context=hint"}
    hf = str(tmp_path / "qwen3") if with_hf else None
    if hf is not None:
        write_hf_teacher(hf)
        env = {"TEACHERS": f"{env['TEACHERS']},{hf};context=hint", "WEIGHTS": ",".join(map(str, HF_WEIGHTS))}
    if layout in TEACHER_IDS:
        env["IDS_FROM"] = "teacher"
    ranks = run_multirank(slime_ranks.opd_train_actor, pipeline * context * tensor, pipeline, context, tensor, None,
                          hf, flags, 1, None, 1, None, None, None, env, [{"hint": c} for c in contexts],
                          timeout=400)
    assert all(r["active"] == "actor" for r in ranks)

    def whole(field, tag=None):
        parts = [r[field] if tag is None else r[field][tag] for r in ranks]
        if context > 1:  # every context-parallel rank holds the whole weights and the reduced gradients
            return parts[0]
        return kit.unsplit(parts, ranks[0]["split"]) if tensor > 1 else kit.whole_stages(parts)

    def on_response(values):  # per sample the whole response's rows, from each context-parallel rank's
        return kit.whole_ids([{**r, "ids": values(r)} for r in ranks], context, tensor)

    rank = {**ranks[-1], "grads": whole("grads"), "ids": on_response(lambda r: r["ids"])}
    t = slime_ranks.TEMPERATURE
    with kit.slime_session("--loss-type", "custom_loss", "--custom-loss-function-path", slime_ranks.OPD_LOSS,
                           *(NOPE if NOPE[0] in flags else ())) as args:
        names = [name for name, _ in kit.provider_func(args)().named_parameters()]
        states = {tag: whole("states", tag) for tag in ranks[0]["states"]}
        data, ids = kit.rollout(0), rank["ids"]
        student = kit.float64_copy(args, [states["actor"][name] for name in names])
        with torch.no_grad():
            snapshot = kit.float64_copy(args, [states["opd_teacher_0"][name] for name in names])
            live = kit.float64_copy(args, [states["actor"][name] for name in names])  # the same weights, no grad

            def seen(contexts_of):
                rollout = data if contexts_of is None else privileged(data, contexts_of)
                logps = [kit.response_logps(module, rollout, t) for module in (snapshot, live)]
                return logps + ([kit.hf_teacher_logps(hf, rollout, t, kit.VOCAB)] if hf is not None else [])

            teachers = seen(contexts)
            without = seen(None)
            shifted = seen([c[1:] + [(c[0] + 1) % kit.VOCAB] for c in contexts])
        expected = kit.dense_opd_loss(kit.response_logps(student, data, t), teachers, data, ids,
                                      HF_WEIGHTS if hf is not None else WEIGHTS)
        expected.backward()
    scored = range(len(teachers))
    if layout in TEACHER_IDS:  # the snapshot's own top-k on its privileged sequence, on the student's rows
        k = int(slime_ranks.OPD_ENV["K"])
        own = [logp.topk(k, dim=-1).indices.sort(dim=-1).values for logp in teachers[0]]
        assert all(torch.equal(i.sort(dim=-1).values, o) for i, o in zip(ids, own))
    # per teacher, per sample [R, k] on the student's response rows
    got = [on_response(lambda r, i=i: [v[i] for v in r["teacher_logprobs"] or []]) for i in scored]

    def miss(reference, teacher):
        return max((g.double() - r.gather(-1, i)).abs().max().item()
                   for g, r, i in zip(got[teacher], reference[teacher], ids))

    errors = {name: [miss(reference, teacher) for teacher in scored]
              for name, reference in (("context", teachers), ("without", without), ("shifted", shifted))}
    (losses,) = rank["losses"]
    loss_error = abs(float(losses["opd_topk_loss"]) - float(expected))
    grads = rank["grads"]
    grad_error = max((grads[name].double() - p.grad).abs().max().item() for name, p in student.named_parameters())
    print(f"slime_opd train_actor {layout}, snapshot / live self-teacher{' / Hugging Face' if hf else ''} with a "
          "context vs dense float64: log-probs at the ids |Δ| " + " / ".join(f"{e:.2e}" for e in errors["context"]) +
          " (without the context " + " / ".join(f"{e:.2e}" for e in errors["without"]) + ", shifted by one " +
          " / ".join(f"{e:.2e}" for e in errors["shifted"]) + f"); loss {float(expected):.6f} |Δloss| "
          f"{loss_error:.2e}, max |Δgrad| {grad_error:.2e}")
    for teacher in scored:
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

    from megatron_rl_patches.testing.multirank import run_multirank

    path = str(tmp_path / "qwen3")
    write_hf_teacher(path)
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
