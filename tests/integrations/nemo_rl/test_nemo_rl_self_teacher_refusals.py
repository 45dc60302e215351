"""`StudentPolicyPass`'s refusals and its privileged layout, without NeMo-RL's source (the NeMo-RL
lane runs it through NeMo-RL's own driver at TP=1/2: tests/integrations/nemo_rl/lane/
test_nemo_rl_self_teacher.py). Every refusal here comes before the student's pass."""
from __future__ import annotations

import types

import pytest
import torch

from megatron_rl_patches.integrations.nemo_rl import StudentPolicyPass, self_teacher_in_setup, self_teacher_policy
from megatron_rl_patches.integrations.nemo_rl.teacher_rows import nemo_rl_data
from megatron_rl_patches.teachers import TeacherBatch


class Student:
    def __init__(self) -> None:
        self.asked: list = []

    def get_topk_logits(self, data, k, micro_batch_size=None, timer=None):  # never reached in these tests
        self.asked.append(data)
        raise AssertionError("the student's pass ran")


def _data(**change):
    data = {"input_ids": torch.tensor([[5, 6, 7, 8, 0], [1, 2, 3, 4, 9]]), "input_lengths": torch.tensor([4, 5]),
            "token_mask": torch.tensor([[0, 0, 1, 1, 0], [0, 1, 1, 1, 1]])}
    data.update(change)
    return data


def test_the_policy_needs_a_context_and_a_student():
    with pytest.raises(ValueError, match=r"context=None\): .*the student scoring itself"):
        StudentPolicyPass(None)
    with pytest.raises(TypeError, match="student Policy"):
        self_teacher_policy("hint", student=object())
    with pytest.raises(RuntimeError, match=r"no student policy yet: build it inside self_teacher_in_setup"):
        self_teacher_policy("hint").get_topk_logits(_data(hint=[[1], [2]]), k=4)
    with pytest.raises(TypeError, match="takes a StudentPolicyPass"):
        with self_teacher_in_setup("hint"):
            pass


@pytest.mark.parametrize("change,error,match", [
    ({}, ValueError, r"context='hint' and neither this batch .* nor a rollout seen by self_teacher_in_setup"),
    ({"hint": [[1, 2]]}, ValueError, r"data\['hint'\] holds 1 contexts for a batch of 2 samples"),
    ({"hint": [[1, 2], None]}, ValueError, r"sample 1"),
    ({"hint": "text"}, TypeError, r"one context per sample"),
])
def test_bad_contexts_are_refused_before_the_students_pass(change, error, match):
    student = Student()
    with pytest.raises(error, match=match):
        self_teacher_policy("hint", student=student).get_topk_logits(_data(**change), k=4)
    assert student.asked == []


def test_the_setup_block_hands_the_student_over_and_restores_nemo_rls_names():
    built = []

    def policy_class(*args, **kwargs):
        built.append(kwargs)
        return Student()

    module = types.SimpleNamespace(Policy=policy_class)
    policy = self_teacher_policy("hint")
    with self_teacher_in_setup(policy, module=module):
        assert module.Policy(name_prefix="teacher") is policy and built == []
        student = module.Policy(name_prefix="policy")
    assert policy.student is student and module.Policy is policy_class
    policy.offload_after_refit()  # nothing moved: the student trains next


def test_the_privileged_batch_in_nemo_rls_layout():
    batch = TeacherBatch([torch.tensor([9, 9, 1, 2]), torch.tensor([8, 3])], [2, 1])
    data = nemo_rl_data(batch)
    assert data["input_ids"].tolist() == [[9, 9, 1, 2], [8, 3, 0, 0]]
    assert data["input_lengths"].tolist() == [4, 2] and data["sample_mask"].tolist() == [1.0, 1.0]
    assert data["token_mask"].tolist() == [[0, 0, 1, 1], [0, 1, 0, 0]]
