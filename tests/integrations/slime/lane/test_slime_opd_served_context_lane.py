"""A served teacher with a privileged context (`URL;engine=vllm;context=hint`) in slime_opd through
slime 624b824a's real `MegatronTrainRayActor.train_actor` at one rank, CP=2 zigzag, TP=2 with sequence
parallelism and PP=2: each sample's
train_metadata["hint"] as the rollout manager's split carries it (`integrations.slime.contexts`),
the real vLLM server (its CPU build) scoring hint + the student's response, a snapshot teacher
without a context beside it. The served teacher's log-probs at the step's ids, the first step's OPD
loss and every gradient against dense float64 on the privileged sequences (the served checkpoint
built alone in float64, as test_slime_opd_served_lane's reference); negative controls: the teacher
scored without its context, and with the context shifted by one token, miss by far more."""
from __future__ import annotations

import pytest
import torch
from test_slime_opd_served_lane import VOCAB, dense_with, served  # noqa: F401 - the module's vLLM server fixture

from megatron_rl_patches.testing.layouts import BY_MARKER

pytestmark = pytest.mark.slime
HINTS = (5, 9, 4, 7)  # context lengths of the kit's 4 samples


def hints() -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in HINTS]


def privileged(data: dict, contexts: list[list[int]]) -> dict:
    """The rollout's samples as the teacher sees them: context + the student's response."""
    tokens = [torch.cat([torch.tensor(c), t[len(t) - r:]]) for c, t, r in
              zip(contexts, data["tokens"], data["response_lengths"])]
    return {**data, "tokens": tokens}


# name -> (pipeline, context, tensor, slime's extra flags); CP=2: each rank its zigzag rows of the privileged
# teacher's scores; TP=2 with sequence parallelism and PP=2: the scores on the last stage's ranks
LAYOUTS = {"1rank": (1, 1, 1, ()), "cp2": (1, 2, 1, ()), "tp2sp": (1, 1, 2, BY_MARKER["sp"].megatron_lm_args),
           "pp2": (2, 1, 1, ())}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_train_actor_with_a_privileged_served_teacher_equals_dense_float64_on_its_context(slime_cpu, served,  # noqa: F811
                                                                                          layout):
    import slime_kit as kit
    import slime_ranks

    from megatron_rl_patches.testing.multirank import run_multirank

    url, directory = served
    contexts = hints()
    entries = {"entries": f"{url};engine=vllm;context=hint,teacher-a", "student": directory,
               "contexts": [{"hint": c} for c in contexts]}
    pipeline, context, tensor, flags = LAYOUTS[layout]
    ranks = run_multirank(slime_ranks.opd_train_actor, pipeline * context * tensor, pipeline, context, tensor, None,
                          None, flags, 1, None, 1, None, None, entries, timeout=400)

    def whole(field, tag=None):  # every context-parallel rank holds the whole weights and reduced gradients;
        parts = [r[field] if tag is None else r[field][tag] for r in ranks]  # else the shards or stages joined
        if context > 1:
            return parts[0]
        return kit.unsplit(parts, ranks[0]["split"]) if tensor > 1 else kit.whole_stages(parts)

    last = ranks[-context * tensor:]  # the last stage's ranks: the teachers' fields live there
    rank = {"states": {tag: whole("states", tag) for tag in ranks[0]["states"]}, "grads": whole("grads"),
            "losses": ranks[-1]["losses"], "ids": kit.whole_ids(last, context, tensor),
            "served_logprobs": kit.whole_ids([{**r, "ids": r["served_logprobs"]} for r in last], context, tensor)}
    with kit.slime_session("--loss-type", "custom_loss", "--custom-loss-function-path", slime_ranks.OPD_LOSS) as args:
        full = kit.provider_func(args)()
        names = [name for name, _ in full.named_parameters()]
        with torch.no_grad():
            for name, p in full.named_parameters():
                p.copy_(rank["states"]["actor"][name])
        data = kit.rollout(0)
        ids = rank["ids"]

        def teacher_at_ids(seen):
            logps = kit.hf_teacher_logps(directory, seen, 1.0, VOCAB)
            return logps, [logp.gather(-1, i) for logp, i in zip(logps, ids)]

        teacher, at_ids = teacher_at_ids(privileged(data, contexts))
        _, without = teacher_at_ids(data)
        _, shifted = teacher_at_ids(privileged(data, [c[1:] + [(c[0] + 1) % VOCAB] for c in contexts]))
        snapshot = [rank["states"]["opd_teacher_1"][name] for name in names]
        expected, student = dense_with(kit, args, full, teacher, snapshot, data, ids)
    got = rank["served_logprobs"]

    def miss(reference):
        return max((g.double() - r).abs().max().item() for g, r in zip(got, reference))

    (losses,) = rank["losses"]
    loss_error = abs(float(losses["opd_topk_loss"]) - float(expected))
    grads = rank["grads"]
    grad_error = max((grads[name].double() - p.grad).abs().max().item() for name, p in student.named_parameters())
    print(f"slime_opd train_actor {layout} with a privileged served teacher vs dense float64: teacher log-probs "
          f"at the ids |Δ| {miss(at_ids):.2e} (without its context {miss(without):.2e}, context shifted by one "
          f"{miss(shifted):.2e}), loss {float(expected):.6f} |Δloss| {loss_error:.2e}, max |Δgrad| {grad_error:.2e}")
    assert miss(at_ids) <= 1e-4
    assert miss(without) > 100 * max(miss(at_ids), 1e-4) and miss(shifted) > 100 * max(miss(at_ids), 1e-4)
    assert loss_error <= 1e-5 * max(1.0, abs(float(expected)))
    for name, p in student.named_parameters():
        torch.testing.assert_close(grads[name].double(), p.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_a_context_past_the_servers_max_model_len_is_named(slime_cpu, served):  # noqa: F811
    import slime_ranks

    from megatron_rl_patches.testing.multirank import run_multirank

    url, directory = served
    contexts = hints()
    contexts[2] = [1] * 250  # + its 8 response ids: past the server's --max-model-len 256
    entries = {"entries": f"{url};engine=vllm;context=hint,teacher-a", "student": directory,
               "contexts": [{"hint": c} for c in contexts]}
    with pytest.raises(RuntimeError, match=r"sample 2 has 258 ids, over .*max model length 256"):
        run_multirank(slime_ranks.opd_train_actor, 1, 1, 1, 1, None, None, (), 1, None, 1, None, None, entries,
                      timeout=400)
