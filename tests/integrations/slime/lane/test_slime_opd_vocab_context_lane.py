"""Full-vocabulary OPD (MEGATRON_RL_PATCHES_OPD_K=vocab) with privileged teachers through slime
624b824a's real `MegatronTrainRayActor.train_actor`: each teacher's final hidden states come from
its pass over sample i's train_metadata["hint"] + the student's response, on the student's
response rows (at CP=2 each rank's rows of the response differ between the two sequences: moved).
In-process: a snapshot (`teacher-a;context=hint`, θ₀) and the live self-teacher
(`student;context=hint`) at one rank, TP=2 with sequence parallelism (each rank's output weights a
vocabulary shard), PP=2, CP=2 (a Hugging Face teacher of another size beside them) and CP=2 with
--allgather-cp; served: a vLLM pooling server's hidden states through `;head=DIR`
(`..;head=DIR;context=hint`) beside a snapshot without a context, at one rank and CP=2. Per
token, each teacher's whole-vocabulary log-probs (its hidden states through its head) against
float64 on the privileged sequence; the first step's loss (forward KL over the whole vocabulary)
and every gradient against dense float64 (the teachers' side detached: no gradient flows through
the live pass); negative controls: the teachers scored without their context, and with it shifted
by one token, miss by far more."""
from __future__ import annotations

import pytest
import torch
from test_slime_opd_served_head_lane import pooled  # noqa: F401 - the module's vLLM pooling server fixture

from megatron_rl_patches.testing.layouts import ALLGATHER_CP_ARGS as ALLGATHER_CP
from megatron_rl_patches.testing.layouts import BY_MARKER
from megatron_rl_patches.testing.layouts import NOPE_ARGS as NOPE

pytestmark = pytest.mark.slime
HINTS = (5, 9, 4, 7)  # context lengths of the kit's 4 samples
TEMPERATURE = 0.8  # slime_ranks.TEMPERATURE
VOCAB_ENV = {"K": "vocab"}


def hints(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in HINTS]


def privileged(data: dict, contexts: list[list[int]] | None) -> dict:
    """The rollout's samples as a teacher sees them: context + the student's response (None: as is)."""
    if contexts is None:
        return data
    tokens = [torch.cat([torch.tensor(c), t[len(t) - r:]]) for c, t, r in
              zip(contexts, data["tokens"], data["response_lengths"])]
    return {**data, "tokens": tokens}


def shifted(contexts: list[list[int]], vocab: int) -> list[list[int]]:
    return [c[1:] + [(c[0] + 1) % vocab] for c in contexts]


def gathered(ranks: list[dict], context: int, tensor: int = 1) -> dict:
    """The last rank's results with every per-row field put together from each context-parallel
    rank's rows (the weights and reduced gradients: every context-parallel rank holds them whole;
    else from the tensor-parallel shards, or the pipeline stages), the teachers' output weights
    from the last stage's tensor-parallel ranks' vocabulary shards."""
    import slime_kit as kit

    def whole(field, tag=None):
        parts = [r[field] if tag is None else r[field][tag] for r in ranks]
        if context > 1:
            return parts[0]
        return kit.unsplit(parts, ranks[0]["split"]) if tensor > 1 else kit.whole_stages(parts)

    last = ranks[-context * tensor:]  # the last stage's: the teachers' fields live there

    def on_response(values):
        return kit.whole_ids([{**r, "ids": values(r)} for r in last], context, tensor)

    shards = last[:tensor]  # the first context-parallel rank's tensor-parallel ranks
    count = len(ranks[-1]["teacher_heads"])
    heads = [torch.cat([r["teacher_heads"][j] for r in shards]) for j in range(count)]
    hidden = [on_response(lambda r, j=j: [sample[j] for sample in r["teacher_hidden"]]) for j in range(count)]
    states = {tag: whole("states", tag) for tag in ranks[0]["states"]}
    return {**ranks[-1], "states": states, "grads": whole("grads"), "hidden": hidden, "teacher_heads": heads}


def teacher_errors(rank: dict, references: dict[str, list[list[torch.Tensor]]]) -> dict[str, list[float]]:
    """Per reference (name -> per teacher, per sample [R, V'] float64 log-softmax), each teacher's
    largest |Δ| of its whole-vocabulary log-probs (its hidden states through its head at the
    rollout's temperature, over the reference's V' ids)."""
    errors: dict[str, list[float]] = {}
    for name, per_teacher in references.items():
        errors[name] = []
        for j, reference in enumerate(per_teacher):
            head = rank["teacher_heads"][j].double()
            worst = 0.0
            for states, want in zip(rank["hidden"][j], reference):
                logits = states.double() @ head[:want.shape[-1]].T / TEMPERATURE
                worst = max(worst, (torch.log_softmax(logits, -1) - want).abs().max().item())
            errors[name].append(worst)
    return errors


def check(label: str, rank: dict, student: torch.nn.Module, expected: torch.Tensor, without: torch.Tensor,
          errors: dict[str, list[float]]) -> None:
    (losses,) = rank["losses"]
    measured = float(losses["opd_vocab_loss"])
    loss_error = abs(measured - float(expected))
    grads = rank["grads"]
    grad_error = max((grads[name].double() - p.grad).abs().max().item() for name, p in student.named_parameters())
    print(f"slime_opd K=vocab train_actor {label} with privileged teachers vs dense float64: per-token log-probs "
          "|Δ| " + " / ".join(f"{e:.2e}" for e in errors["context"]) + " (without the context " +
          " / ".join(f"{e:.2e}" for e in errors["without"]) + ", shifted by one " +
          " / ".join(f"{e:.2e}" for e in errors["shifted"]) + f"); loss {float(expected):.6f} |Δloss| "
          f"{loss_error:.2e} (without the contexts {abs(measured - float(without)):.2e}), max |Δgrad| {grad_error:.2e}")
    for j, error in enumerate(errors["context"]):
        assert error <= 1e-4  # float32 passes
        assert min(errors["without"][j], errors["shifted"][j]) > 1000 * max(error, 1e-6)
    tolerance = 1e-5 * max(1.0, abs(float(expected)))
    assert loss_error <= tolerance
    assert abs(measured - float(without)) > 10 * tolerance  # the loss of the teachers without their contexts
    for name, p in student.named_parameters():
        torch.testing.assert_close(grads[name].double(), p.grad, rtol=1e-4, atol=1e-6, msg=name)


# name -> (pipeline stages, context-parallel size, tensor-parallel size, slime's extra flags, whether a
# Hugging Face teacher scores beside them; its 64 ids unpadded, as the actor's output layer: K=vocab
# compares the layers row by row). With --allgather-cp the states go from a pass's contiguous rows to
# the privileged zigzag rows, then to the student's, then to the training step's contiguous rows (a
# Hugging Face teacher is refused there). At TP=2 with sequence parallelism the passes' states are
# gathered whole per rank and each rank's heads are its vocabulary shard; at PP=2 the teachers' fields
# live on the last stage.
LAYOUTS = {"1rank": (1, 1, 1, (), False), "tp2sp": (1, 1, 2, BY_MARKER["sp"].megatron_lm_args, False),
           "pp2": (2, 1, 1, (), False), "cp2": (1, 2, 1, ("--make-vocab-size-divisible-by", "64"), True),
           "cp2ag": (1, 2, 1, ALLGATHER_CP, False)}
WEIGHTS = {False: (0.3, 0.7), True: (0.3, 0.5, 0.2)}  # the snapshot, the live self-teacher[, Hugging Face]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_in_process_privileged_teachers_full_vocabulary_equals_dense_float64(slime_cpu, layout, tmp_path):
    import slime_kit as kit
    import slime_ranks
    from test_slime_opd_privileged_lane import write_hf_teacher

    from megatron_rl_patches.testing.multirank import run_multirank

    pipeline, context, tensor, flags, with_hf = LAYOUTS[layout]
    contexts = hints(kit.VOCAB)
    weights = WEIGHTS[with_hf]
    entries = ["teacher-a;context=hint", "student;context=hint"]
    hf = str(tmp_path / "qwen3") if with_hf else None
    if hf is not None:
        write_hf_teacher(hf)
        entries.append(f"{hf};context=hint")
    env = {**VOCAB_ENV, "TEACHERS": ",".join(entries), "WEIGHTS": ",".join(map(str, weights))}
    ranks = run_multirank(slime_ranks.opd_train_actor, pipeline * context * tensor, pipeline, context, tensor, None,
                          hf, flags, 1, None, 1, None, None, None, env, [{"hint": c} for c in contexts], timeout=400)
    for first in ranks[:-context * tensor]:  # the stages before the last hold no teacher field
        assert first["teacher_hidden"] is None and first["losses"] is None
    rank = gathered(ranks, context, tensor)
    with kit.slime_session("--loss-type", "custom_loss", "--custom-loss-function-path", slime_ranks.OPD_LOSS,
                           *(NOPE if NOPE[0] in flags else ())) as args:
        names = [name for name, _ in kit.provider_func(args)().named_parameters()]
        data = kit.rollout(0)
        student = kit.float64_copy(args, [rank["states"]["actor"][name] for name in names])
        with torch.no_grad():
            snapshot = kit.float64_copy(args, [rank["states"]["opd_teacher_0"][name] for name in names])
            live = kit.float64_copy(args, [rank["states"]["actor"][name] for name in names])  # no grad

            def seen(contexts_of):
                rollout = privileged(data, contexts_of)
                logps = [kit.response_logps(module, rollout, TEMPERATURE) for module in (snapshot, live)]
                return logps + ([kit.hf_teacher_logps(hf, rollout, TEMPERATURE, kit.VOCAB)] if hf else [])

            references = {"context": seen(contexts), "without": seen(None),
                          "shifted": seen(shifted(contexts, kit.VOCAB))}
        dense_student = kit.response_logps(student, data, TEMPERATURE)
        with torch.no_grad():
            without = kit.dense_vocab_loss(dense_student, references["without"], data, weights)
        expected = kit.dense_vocab_loss(dense_student, references["context"], data, weights)
        expected.backward()
    check(layout, rank, student, expected, without, teacher_errors(rank, references))


@pytest.mark.parametrize("context", [1, 2])
def test_a_served_head_with_a_context_full_vocabulary_equals_dense_float64(slime_cpu, pooled, context):  # noqa: F811
    """The served `;head=DIR;context=hint` first (its pooling server's states of hint + response
    through the head), a snapshot without a context second, mixed 0.3 / 0.7."""
    import slime_kit as kit
    import slime_ranks
    from test_slime_opd_served_head_lane import VOCAB

    from megatron_rl_patches.testing.multirank import run_multirank

    url, directory = pooled
    contexts = hints(VOCAB)
    served = {"entries": f"{url};engine=vllm;head={directory};context=hint,teacher-a", "student": directory,
              "ids_from": "student", "temperature": str(TEMPERATURE), "contexts": [{"hint": c} for c in contexts]}
    ranks = run_multirank(slime_ranks.opd_train_actor, context, 1, context, 1, None, None, (), 1, None, 1, None,
                          None, served, VOCAB_ENV, timeout=600)
    rank = gathered(ranks, context)
    weights = (0.3, 0.7)
    with kit.slime_session("--loss-type", "custom_loss", "--custom-loss-function-path", slime_ranks.OPD_LOSS) as args:
        names = [name for name, _ in kit.provider_func(args)().named_parameters()]
        data = kit.rollout(0)
        student = kit.float64_copy(args, [rank["states"]["actor"][name] for name in names])
        with torch.no_grad():
            other = kit.response_logps(kit.float64_copy(args, [rank["states"]["opd_teacher_1"][n] for n in names]),
                                       data, TEMPERATURE)

        def seen(contexts_of):
            return [kit.hf_teacher_logps(directory, privileged(data, contexts_of), TEMPERATURE, VOCAB), other]

        references = {"context": seen(contexts), "without": seen(None), "shifted": seen(shifted(contexts, VOCAB))}
        dense_student = kit.response_logps(student, data, TEMPERATURE)
        with torch.no_grad():
            without = kit.dense_vocab_loss(dense_student, references["without"], data, weights)
        expected = kit.dense_vocab_loss(dense_student, references["context"], data, weights)
        expected.backward()
    errors = teacher_errors(rank, {name: per_teacher[:1] for name, per_teacher in references.items()})
    check(f"cp{context} served head", rank, student, expected, without, errors)
