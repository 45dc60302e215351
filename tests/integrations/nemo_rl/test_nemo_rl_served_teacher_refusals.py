"""`ServedTeacherPolicy`'s refusals and row plan, without NeMo-RL's source or a server (the NeMo-RL
lane runs it against a real vLLM server: tests/integrations/nemo_rl/lane/test_nemo_rl_served_teacher.py).
Every refusal here comes before any request: the URL answers nothing."""
from __future__ import annotations

import pytest
import torch

from megatron_rl_patches.integrations.nemo_rl import ServedTeacherPolicy, served_teacher_in_setup, served_teacher_policy
from megatron_rl_patches.integrations.nemo_rl.teacher_rows import filler, rows_of, states_of

NOWHERE = "http://127.0.0.1:9"  # the discard port: nothing is asked before the checks


def _data(**change):
    data = {"input_ids": torch.tensor([[5, 6, 7, 8, 0], [1, 2, 3, 4, 9]]), "input_lengths": torch.tensor([4, 5]),
            "token_mask": torch.tensor([[0, 0, 1, 1, 0], [0, 1, 1, 1, 1]])}
    data.update(change)
    return data


def test_k_other_than_the_teachers_is_refused_naming_nemo_rls_setting():
    policy = served_teacher_policy(NOWHERE, top_k=64)
    with pytest.raises(ValueError, match=r"k=8\).*top_k=64.*topk_logits_k"):
        policy.get_topk_logits(_data(), k=8)
    with pytest.raises(ValueError, match="topk_logits_k"):
        policy.get_topk_logits(_data(), k=True)


def test_a_policy_takes_a_served_teacher_only():
    with pytest.raises(TypeError, match="ServedTeacher"):
        ServedTeacherPolicy("http://host:8000")


@pytest.mark.parametrize("change,error,match", [
    ({"input_ids": None}, ValueError, "no 'input_ids'"),
    ({"input_ids": torch.zeros(2, 5)}, TypeError, r"\[B, S\] integer tensor, got torch\.Size\(\[2, 5\]\)"),
    ({"input_lengths": torch.tensor([4])}, TypeError, r"\[B\] = \[2\]"),
    ({"input_lengths": torch.tensor([4, 6])}, ValueError, r"\[1, 5\]"),
    ({"token_mask": [[0, 0, 1, 1, 0], [0, 1, 1, 1, 1]]}, TypeError, r"data\['token_mask'\] must be a \[B, S\] = "
                                                                   r"\[2, 5\] tensor.*got list"),
    ({"token_mask": torch.tensor([[0, 1, 1, 1, 1]])}, TypeError, r"token_mask'\] must be .*got \(1, 5\)"),
    ({"token_mask": torch.full((2, 5), 0.5)}, TypeError, r"token_mask'\] must be .*of 0 / 1"),
])
def test_a_batch_nemo_rl_would_not_send_is_refused_by_name(change, error, match):
    data = _data(**change)
    data = {key: value for key, value in data.items() if value is not None}
    before = {key: value.clone() if isinstance(value, torch.Tensor) else value for key, value in data.items()}
    with pytest.raises(error, match=match):
        served_teacher_policy(NOWHERE, top_k=4).get_topk_logits(data, k=4)
    assert all(torch.equal(before[key], data[key]) if isinstance(data[key], torch.Tensor) else before[key] == data[key]
               for key in before)


def test_rows_start_at_the_first_masked_token_and_without_a_mask_at_one():
    _, lengths, starts = rows_of(_data())
    assert lengths.tolist() == [4, 5] and starts == [2, 1]
    assert rows_of(_data(token_mask=torch.zeros(2, 5)))[2] == [4, 5]  # nothing to score: no rows
    data = _data()
    del data["token_mask"]
    assert rows_of(data)[2] == [1, 1]


def test_the_edges_of_a_batch_nemo_rl_sends_are_taken():
    """A sample of one token (nothing to score), a 0 / 1 mask in floats, a batch without samples."""
    _, lengths, starts = rows_of(_data(input_lengths=torch.tensor([1, 5])))
    assert lengths.tolist() == [1, 5] and starts == [1, 1]
    assert rows_of(_data(token_mask=_data()["token_mask"].float()))[2] == [2, 1]
    empty = states_of([], [], 3)
    assert empty.shape == (0, 3, 0) and empty.dtype == torch.float32


def test_unread_rows_are_finite_log_probs_that_leave_a_tail():
    values, ids = filler(2, 3, 4)
    assert ids[1, 2].tolist() == [0, 1, 2, 3]
    assert torch.allclose(values.double().exp().sum(-1), torch.full((2, 3), 0.8, dtype=torch.float64))


def test_in_setup_only_the_teacher_policy_is_the_served_one_and_the_name_is_restored():
    import types

    built = []
    module = types.ModuleType("distillation")
    def nemo_rls_policy(*args, **kwargs):
        built.append(kwargs["name_prefix"])
        return "nemo-rl's Policy"

    module.Policy = nemo_rls_policy  # type: ignore[attr-defined]
    original = module.Policy
    policy = served_teacher_policy(NOWHERE)
    with served_teacher_in_setup(policy, module) as given:
        assert given is policy and module.Policy(name_prefix="teacher", init_optimizer=False) is policy
        assert module.Policy(name_prefix="policy") == "nemo-rl's Policy" and built == ["policy"]
    assert module.Policy is original
    with pytest.raises(TypeError, match="ServedTeacherPolicy"):
        with served_teacher_in_setup("http://host:8000", module):
            pass
    assert module.Policy is original


def test_in_setup_a_teacher_temperature_the_server_cannot_give_is_refused_by_name():
    import types

    module = types.ModuleType("distillation")
    module.Policy = lambda *args, **kwargs: None  # type: ignore[attr-defined]
    policy = served_teacher_policy(NOWHERE)
    with served_teacher_in_setup(policy, module):
        with pytest.raises(ValueError, match=r"generation.temperature=0.7.*head=.*temperature=0.7"):
            module.Policy(name_prefix="teacher", config={"generation": {"temperature": 0.7}})
        assert module.Policy(name_prefix="teacher", config={"generation": {"temperature": 1.0}}) is policy
        assert module.Policy(name_prefix="teacher", config={"generation": None}) is policy


def test_full_vocabulary_needs_a_head_and_a_bool():
    with pytest.raises(ValueError, match=r"^ServedTeacherPolicy\(full_vocabulary=True\) needs a teacher with a head "
                                         r"\(served_teacher_policy\(url, head=DIR, full_vocabulary=True\) against a "
                                         r"vLLM pooling server\)"):
        served_teacher_policy(NOWHERE, full_vocabulary=True)
    with pytest.raises(TypeError, match=r"full_vocabulary=\.\.\.\) must be True or False"):
        served_teacher_policy(NOWHERE, full_vocabulary=1)  # type: ignore[arg-type]


def test_full_vocabulary_refuses_a_teacher_plan_of_the_invariant_mode_it_cannot_run():
    """Issue 110 item 2: the whole-vocabulary divergence has no invariant mode, so a teacher whose
    plan asks it is refused when the policy is built (never dropped); top-k distillation takes it."""
    from megatron_rl_patches.teachers import VOCAB, ScoringPlan, ServedTeacher, TeacherHead

    head = TeacherHead(torch.zeros(12, 4), vocab_size=12, padded_vocab_size=12, first_id=0, source="/ckpt")
    teacher = ServedTeacher(NOWHERE, head=head, plan=ScoringPlan(VOCAB, invariant=True))
    with pytest.raises(ValueError, match=r"^ServedTeacherPolicy\(full_vocabulary=True\): the teacher's plan asks the "
                                         r"invariant mode, and the whole-vocabulary divergence \(lm_head_divergence\) "
                                         r"has none yet"):
        ServedTeacherPolicy(teacher, full_vocabulary=True)
    assert ServedTeacherPolicy(ServedTeacher(NOWHERE, head=head, plan=ScoringPlan(VOCAB)), full_vocabulary=True)
    assert ServedTeacherPolicy(ServedTeacher(NOWHERE, head=head, plan=ScoringPlan(4, invariant=True))).teacher


def test_full_vocabulary_needs_a_head_its_workers_can_read_again():
    """The student workers build the loss's head from the head's directory: a head with no source
    (built by hand) is refused when the policy is built, not when a worker reads ''."""
    from megatron_rl_patches.teachers import TeacherHead

    head = TeacherHead(torch.zeros(12, 4), vocab_size=12, padded_vocab_size=12, first_id=0, source="")
    with pytest.raises(ValueError, match=r"full_vocabulary=True\) needs a head read from a directory.*head=DIR"):
        served_teacher_policy(NOWHERE, top_k=4, head=head, full_vocabulary=True)
    assert served_teacher_policy(NOWHERE, top_k=4, head=head).teacher.head is head  # top-k only: no re-read


@pytest.mark.parametrize("word", ["student", "student;context=hint"])
def test_the_live_self_teacher_as_a_served_url_is_refused_pointing_to_the_students_own_policy(word):
    with pytest.raises(ValueError) as refused:
        served_teacher_policy(word, context="hint")
    words = str(refused.value)
    assert words.startswith(f"served_teacher_policy({word!r})") and "self_teacher_policy(context=KEY)" in words
