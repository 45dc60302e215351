"""The live self-teacher (`student;context=KEY`) in the public teacher step at tensor parallel 2, on a
real megatron-core GPTModel on CPU (gloo), through `megatron_host(..., student_pass=fn)`: the host's
pass returns whole hidden rows and each rank's shard of the output weight (Megatron's padding
included) and the teacher's top-k, tail and token log-probs are computed vocab-parallel by the
fused head (no logits, no [R, V] gather). One world,
many checks: the scores equal the float64 forward of the 1-rank model (the same weights) on
context + response and the 1-rank step's scores; each rank's gradient shard equals the float64
reference's with the teacher's terms detached; one rank's missing context, one rank's other context
and one rank's gathered (not parallel) output weight are each the same clear error on both ranks, never a
hang."""
from __future__ import annotations

import pytest
import torch

import megatron_rl_patches
from megatron_rl_patches import topk_kl, topk_logprobs
from megatron_rl_patches.teachers import (
    LoopHost,
    StudentHidden,
    TeacherBatch,
    TeacherStep,
    build_teachers,
    megatron_host,
)
from megatron_rl_patches.testing.multirank import run_multirank
from megatron_rl_patches.testing.student_hidden import response_hidden

V, PADDED, K, TAU = 50, 64, 6, 0.8  # the real vocabulary, the model's (padded) output rows, buckets, temperature
BOUND = 1e-5


def student_batch() -> tuple[TeacherBatch, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(5)
    lengths, starts, contexts = [12, 20], [4, 7], [9, 15]
    batch = TeacherBatch([torch.randint(0, V, (n,), generator=gen) for n in lengths], starts)
    return batch, [torch.randint(0, V, (n,), generator=gen) for n in contexts]


def rows_of(model, ids: torch.Tensor, start: int) -> torch.Tensor:
    """The model's logits (this rank's shard at TP) of the rows that score ids[start:]."""
    return model(ids[None], torch.arange(len(ids))[None], None)[0, start - 1:-1]


def step_and_loss(model, host, batch, contexts, tp_group=None) -> tuple:
    """The self-teacher's scores through the step and the student's (k+1)-bucket forward-KL gradients."""
    (teacher,) = build_teachers("student;context=hint", host, top_k=K, temperature=TAU)
    step = TeacherStep([teacher], host)
    step.send(batch, contexts={"hint": contexts})
    (scores,) = step.collect()
    loss = torch.zeros(())
    for i, (ids, start) in enumerate(zip(batch.sequences, batch.response_starts)):
        s_logp, s_tail = topk_logprobs(rows_of(model, ids, start), scores.topk_ids[i], tp_group=tp_group,
                                       vocab_size=V, temperature=TAU)
        loss = loss + topk_kl(s_logp, s_tail, scores.topk_log_probs[i].float(), scores.tail_log_probs[i].float(),
                              divergence="forward_kl").sum()
    loss.backward()
    return step, scores, {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def refused(step: TeacherStep, batch: TeacherBatch, contexts: dict) -> str:
    step.send(batch, contexts=contexts)
    try:
        step.collect()
    except (ValueError, TypeError, RuntimeError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def tp2_world(rank: int, world_size: int) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_rl_patches.testing.megatron_cpu import build_tiny_gpt, megatron_on_cpu

    batch, contexts = student_batch()
    out: dict = {}
    with megatron_on_cpu(tensor_parallel=2):
        tp = ps.get_tensor_model_parallel_group()
        model = build_tiny_gpt(vocab_size=PADDED, seq_length=64, seed=0)

        megatron_rl_patches.apply(only="gpt_output_processor")  # megatron-core < 0.18: its output_processor= hook

        def student_pass(privileged: TeacherBatch) -> StudentHidden:  # whole hidden rows, the weight's shard
            return response_hidden(model, privileged)

        # a hand-written Megatron loop's host: Megatron-LM's padding of 50 ids to a multiple of 32 x TP = 64
        host = megatron_host(ps, V, make_vocab_size_divisible_by=32, student_pass=student_pass)
        assert (host.padded_vocab_size, host.tp_group) == (PADDED, tp)
        step, scores, grads = step_and_loss(model, host, batch, contexts, tp)
        out["scores"] = scores
        out["grads"] = grads
        # one rank's bad context: a missing key, another (valid) context; each the same error on both ranks
        out["missing"] = refused(step, batch, {"hint": contexts} if rank == 0 else {"other": contexts})
        out["other"] = refused(step, batch, {"hint": contexts if rank == 0 else [c.roll(1) for c in contexts]})

        def gathered_on_rank_1(privileged: TeacherBatch) -> StudentHidden:
            given = student_pass(privileged)
            if rank == 0:
                return given
            return StudentHidden(given.hidden, torch.cat([given.output_weight] * 2))  # gathered [64, H] (wrongly)

        host = LoopHost(V, tp, dist.group.WORLD, student_pass=gathered_on_rank_1, tp_group=tp,
                        padded_vocab_size=PADDED)
        (teacher,) = build_teachers("student;context=hint", host, top_k=K, temperature=TAU)
        out["gathered"] = refused(TeacherStep([teacher], host), batch, {"hint": contexts})
        out["after"] = step.send(batch, contexts={"hint": contexts}) or step.collect()[0]  # the step still works
    return out


def shard_of(full: torch.Tensor, local: torch.Tensor, rank: int) -> torch.Tensor:
    """The rank's part of a 1-rank tensor: whole where the shapes agree, else its contiguous half on the
    split dimension (megatron-core's CPU initialization splits one master weight)."""
    if full.shape == local.shape:
        return full
    (dim,) = [d for d in range(full.dim()) if full.shape[d] != local.shape[d]]
    return full.chunk(2, dim=dim)[rank]


@pytest.mark.megatron
@pytest.mark.multirank
def test_the_live_self_teacher_at_tp2_equals_float64_and_one_rank():
    from megatron_rl_patches.testing.megatron_cpu import build_tiny_gpt, megatron_on_cpu

    batch, contexts = student_batch()
    ranks = run_multirank(tp2_world, 2, timeout=300)
    with megatron_on_cpu():
        model = build_tiny_gpt(vocab_size=PADDED, seq_length=64, seed=0)
        model64 = build_tiny_gpt(vocab_size=PADDED, seq_length=64, seed=0).double()

        megatron_rl_patches.apply(only="gpt_output_processor")

        def student_pass(privileged: TeacherBatch) -> StudentHidden:
            return response_hidden(model, privileged)

        _, one_rank, _ = step_and_loss(model, LoopHost(V, student_pass=student_pass), batch, contexts)
        scores = ranks[0]["scores"]
        total = torch.zeros((), dtype=torch.float64)
        for i, (ids, start) in enumerate(zip(batch.sequences, batch.response_starts)):
            response = ids[start:]
            teacher = torch.log_softmax(rows_of(model64, torch.cat([contexts[i], response]), len(contexts[i]))[:, :V]
                                        / TAU, -1).detach()
            for result in ranks:  # the same scores on both ranks, equal to float64 and to the 1-rank step
                got = result["scores"]
                assert torch.equal(got.topk_ids[i], scores.topk_ids[i]) and torch.equal(got.topk_ids[i],
                                                                                          one_rank.topk_ids[i])
                torch.testing.assert_close(got.token_log_probs[i], teacher.gather(1, response[:, None])[:, 0], rtol=0,
                                           atol=BOUND)
                torch.testing.assert_close(got.topk_log_probs[i], teacher.gather(1, got.topk_ids[i]), rtol=0,
                                           atol=BOUND)
                torch.testing.assert_close(got.tail_log_probs[i], torch.logsumexp(
                    teacher.scatter(1, got.topk_ids[i], float("-inf")), -1), rtol=0, atol=BOUND)
                for part in ("token_log_probs", "topk_log_probs", "tail_log_probs"):
                    torch.testing.assert_close(getattr(got, part)[i], getattr(one_rank, part)[i], rtol=0, atol=BOUND)
            # the float64 student's loss with the teacher's terms detached (the buckets at the teacher's ids)
            student = torch.log_softmax(rows_of(model64, ids, start)[:, :V] / TAU, -1)
            top = scores.topk_ids[i]

            def buckets(log_probs: torch.Tensor, top: torch.Tensor = top) -> torch.Tensor:
                return torch.cat([log_probs.gather(1, top), torch.logsumexp(
                    log_probs.scatter(1, top, float("-inf")), -1, keepdim=True)], 1)

            t, s = buckets(teacher), buckets(student)
            total = total + (t.exp() * (t - s)).sum()
        total.backward()
        reference = {name: p.grad for name, p in model64.named_parameters() if p.grad is not None}
    for rank, result in enumerate(ranks):
        assert result["grads"].keys() == reference.keys() and reference
        for name, grad in result["grads"].items():
            torch.testing.assert_close(grad.double(), shard_of(reference[name], grad, rank), rtol=1e-4, atol=BOUND,
                                       msg=f"rank {rank} {name}")
        for got, want in zip(result["after"].token_log_probs, scores.token_log_probs):  # after the refusals
            assert torch.equal(got, want)
    for case, words in (("missing", "the contexts hold no key 'hint' (they hold ['other'])"),
                        ("other", "sent different privileged contexts for the in-process teachers"),
                        ("gathered", "returned an output_weight of (64, 32)")):
        assert ranks[0][case] == ranks[1][case], (case, ranks[0][case], ranks[1][case])
        assert words in ranks[0][case] and "rank" in ranks[0][case], (case, ranks[0][case])
