"""A teacher at its own layout through slime 624b824a's real code (issue 58), in one spawned 2-rank
gloo world (the student at TP=1 x DP=2, slime_layout_ranks.layout_world): slime_opd's real
`MegatronTrainRayActor.train_actor` (two rollouts) with a snapshot teacher and a Hugging Face
teacher of another size written `PATH;tp=2` gives the teacher log-probs, the OPD loss of each step
and every reduced gradient of the same run with the teacher at the student's layout (1e-6); and the
`prm_teacher` role from that directory at `prm_teacher;tp=2`, built by slime's real
`initialize_model_and_optimizer` and passed to slime's real `forward_only`, gives each rank (its own
rollout) the log-probs of the role at the student's layout on slime's packed route (1e-6). Then the
student at PP=2 and at CP=2 over the same ranks beside the `PATH;tp=2` teacher, against the
teacher at the student's layout (1e-6); and the `PATH;tp=2` teacher with a privileged context
(`;context=hint`) against it at the student's layout with its context."""
from __future__ import annotations

import sys

import pytest
import torch

from megatron_rl_patches.testing import layouts

pytestmark = [pytest.mark.slime, layouts.mark("thd")]

OTHER = dict(hidden_size=48, num_hidden_layers=4, intermediate_size=64, vocab_size=64, max_position_embeddings=64)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    if "slime_standins" not in sys.modules:  # the lane's conftest installs them where slime's source is found
        pytest.skip("slime is not importable; run `make test-slime SLIME=... MEGATRON_LM=...`")
    from slime_layout_ranks import layout_world  # the lane folder is on sys.path (conftest)

    from megatron_rl_patches.testing.hf_checkpoints import tiny_hf_config, write_tiny_checkpoint
    from megatron_rl_patches.testing.multirank import run_multirank

    hf = tmp_path_factory.mktemp("hf") / "teacher"
    write_tiny_checkpoint(hf, tiny_hf_config("qwen3", **OTHER), seed=12)
    return run_multirank(layout_world, 2, str(hf), timeout=600)


def _close(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest error beyond 1e-6 relative (one fp32 ulp of a log-prob): <= 1e-6 passes."""
    error = (got.double() - want.double()).abs() - 1e-6 * want.double().abs()
    return error.max().item() if error.numel() else 0.0


def test_train_actor_with_a_hugging_face_teacher_at_tp2_equals_it_at_the_students_layout(slime_cpu, world):
    from megatron_rl_patches.integrations.slime import opd as slime_opd

    for rank in world:
        at, student = rank["tp2"], rank["student_layout"]
        assert at["keys"] == student["keys"] == sorted([slime_opd.IDS, slime_opd.TEACHER_LOGPROBS,
                                                        slime_opd.TEACHER_TAILS])
        assert at["hf_layers"] == student["hf_layers"] == [[1, 2, 3, 4]]  # one chunk, the 4 layers
        assert all(torch.equal(a, b) for a, b in zip(at["ids"], student["ids"]))  # the same student, the same ids
        errors = [_close(a, b) for a, b in zip(at["teacher_logprobs"], student["teacher_logprobs"])]
        print(f"slime_opd train_actor DP=2, Hugging Face teacher at tp=2 vs at the student's layout: teacher "
              f"log-probs max error beyond 1e-6 relative {max(errors):.2e}; losses "
              f"{[float(s['opd_topk_loss']) for s in at['losses']]} vs "
              f"{[float(s['opd_topk_loss']) for s in student['losses']]}")
        assert len(at["teacher_logprobs"]) == 4 and max(errors) <= 1e-6
        assert len(at["losses"]) == len(student["losses"]) == 2  # both rollouts' steps
        for mine, theirs in zip(at["losses"], student["losses"]):
            assert abs(float(mine["opd_topk_loss"]) - float(theirs["opd_topk_loss"])) <= 1e-6 * max(
                1.0, abs(float(theirs["opd_topk_loss"])))
        assert sorted(at["grads"]) == sorted(student["grads"])
        for name, grad in student["grads"].items():
            torch.testing.assert_close(at["grads"][name], grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("student", ["pp2", "cp2"])
def test_train_actor_beside_a_student_at_pp2_or_cp2_equals_the_teacher_at_the_students_layout(slime_cpu, world,
                                                                                              student):
    """The student at PP=2 (the first stage takes part in the teacher's passes with no samples) or
    at CP=2 (each rank its zigzag rows of every sample), the teacher written `PATH;tp=2` over the
    same 2 ranks: the scores slime keeps, the loss and every reduced gradient equal the run with
    the teacher at the student's layout."""
    scored = 0
    for rank in world:
        at, theirs = rank[f"{student}_tp2"], rank[f"{student}_student_layout"]
        if theirs["teacher_logprobs"] is None:  # a pipeline stage before the last
            assert at["teacher_logprobs"] is None and at["losses"] is None
        else:
            assert all(torch.equal(a, b) for a, b in zip(at["ids"], theirs["ids"]))
            errors = [_close(a, b) for a, b in zip(at["teacher_logprobs"], theirs["teacher_logprobs"])]
            assert len(errors) == 4 and max(errors) <= 1e-6, errors
            for mine, other in zip(at["losses"], theirs["losses"]):
                assert abs(float(mine["opd_topk_loss"]) - float(other["opd_topk_loss"])) <= 1e-6 * max(
                    1.0, abs(float(other["opd_topk_loss"])))
            scored += 1
        for name, grad in theirs["grads"].items():
            torch.testing.assert_close(at["grads"][name], grad, rtol=1e-5, atol=1e-6, msg=name)
    assert scored == (1 if student == "pp2" else 2)
    if student == "cp2":  # each rank its own rows of the same samples
        assert any(a.shape != b.shape for a, b in zip(world[0]["cp2_tp2"]["teacher_logprobs"],
                                                      world[1]["cp2_tp2"]["teacher_logprobs"]))


def test_a_privileged_teacher_at_tp2_equals_it_at_the_students_layout(slime_cpu, world):
    """`PATH;tp=2;context=hint` (each sample's train_metadata ids before its response): the teacher
    log-probs, the loss and every reduced gradient equal the privileged teacher at the student's
    layout (itself against float64 on context + response: test_slime_opd_privileged_lane.py);
    controls: the teacher without its context ("tp2"'s first rollout) and with each context rolled
    by one token miss by far."""
    for rank in world:
        at, student = rank["ctx_tp2"], rank["ctx_student_layout"]
        assert all(torch.equal(a, b) for a, b in zip(at["ids"], student["ids"]))
        error = max(_close(a, b) for a, b in zip(at["teacher_logprobs"], student["teacher_logprobs"]))
        without = max((a.double() - b.double()).abs().max().item()
                      for a, b in zip(at["teacher_logprobs"], rank["tp2"]["teacher_logprobs"]))
        rolled = max((a.double() - b.double()).abs().max().item()
                     for a, b in zip(at["teacher_logprobs"], rank["rolled_tp2"]["teacher_logprobs"]))
        print(f"slime_opd train_actor DP=2, a privileged Hugging Face teacher at tp=2 vs at the student's layout: "
              f"max error beyond 1e-6 relative {error:.2e}; controls: without its context {without:.2e}, context "
              f"rolled {rolled:.2e}")
        assert len(at["teacher_logprobs"]) == 4 and error <= 1e-6
        assert min(without, rolled) > 1e-2
        (mine,), (theirs,) = at["losses"], student["losses"]
        assert abs(float(mine["opd_topk_loss"]) - float(theirs["opd_topk_loss"])) <= 1e-6 * max(
            1.0, abs(float(theirs["opd_topk_loss"])))
        for name, grad in student["grads"].items():
            torch.testing.assert_close(at["grads"][name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_a_privileged_teacher_at_tp2_beside_a_student_at_cp2_equals_it_at_the_students_layout(slime_cpu, world):
    """The student at CP=2 (each rank its zigzag rows; the privileged sequence's rows differ from the
    student's), `PATH;tp=2;context=hint` against `PATH;context=hint` at the student's layout: the
    scores slime keeps, the loss and every reduced gradient."""
    for rank in world:
        at, theirs = rank["cp2_ctx_tp2"], rank["cp2_ctx_student_layout"]
        assert all(torch.equal(a, b) for a, b in zip(at["ids"], theirs["ids"]))
        errors = [_close(a, b) for a, b in zip(at["teacher_logprobs"], theirs["teacher_logprobs"])]
        print(f"CP=2 student, privileged teacher at tp=2 vs at the student's layout: max error beyond 1e-6 "
              f"relative {max(errors):.2e}")
        assert len(errors) == 4 and max(errors) <= 1e-6, errors
        (mine,), (other,) = at["losses"], theirs["losses"]
        assert abs(float(mine["opd_topk_loss"]) - float(other["opd_topk_loss"])) <= 1e-6 * max(
            1.0, abs(float(other["opd_topk_loss"])))
        for name, grad in theirs["grads"].items():
            torch.testing.assert_close(at["grads"][name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_the_prm_teacher_role_at_tp2_gives_each_rank_its_log_probs_at_the_students_layout(slime_cpu, world):
    import slime_kit as kit

    for rank, result in enumerate(world):
        at, student = result["role"]["tp2"], result["role"]["student_layout"]
        assert at["at_layout"] and not student["at_layout"]
        data = kit.rollout(10 + rank)
        assert [tuple(t.shape) for t in at["log_probs"]] == [(r,) for r in data["response_lengths"]]
        error = max(_close(a, b) for a, b in zip(at["log_probs"], student["log_probs"]))
        print(f"rank {rank}: prm_teacher at tp=2 vs at the student's layout (slime forward_only): max error beyond "
              f"1e-6 relative {error:.2e}")
        assert error <= 1e-6
    assert not all(torch.equal(a, b) for a, b in zip(world[0]["role"]["tp2"]["log_probs"],
                                                      world[1]["role"]["tp2"]["log_probs"]))  # each rank its own
