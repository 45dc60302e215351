"""`PrivilegedTeacherPolicy`'s refusals and its setup block, without NeMo-RL's source (the NeMo-RL
lane scores through NeMo-RL's own driver at TP=1/2: tests/integrations/nemo_rl/lane/
test_nemo_rl_self_teacher.py). Every refusal here comes before the teacher's pass."""
from __future__ import annotations

import types

import pytest
import torch

from megatron_rl_patches.integrations.nemo_rl import (
    PrivilegedTeacherPolicy,
    privileged_teacher_in_setup,
    privileged_teacher_policy,
)


class Teacher:
    def __init__(self) -> None:
        self.asked: list = []
        self.moves: list = []

    def get_topk_logits(self, data, k, micro_batch_size=None, timer=None):  # never reached in these tests
        self.asked.append(data)
        raise AssertionError("the teacher's pass ran")

    def prepare_for_lp_inference(self):
        self.moves.append("prepare")

    def offload_after_refit(self):
        self.moves.append("after")

    def offload_before_refit(self):
        self.moves.append("before")


def _data(**change):
    data = {"input_ids": torch.tensor([[5, 6, 7, 8, 0], [1, 2, 3, 4, 9]]), "input_lengths": torch.tensor([4, 5]),
            "token_mask": torch.tensor([[0, 0, 1, 1, 0], [0, 1, 1, 1, 1]])}
    data.update(change)
    return data


def test_the_policy_needs_a_context_and_a_teacher():
    with pytest.raises(ValueError, match=r"context=None\): without a privileged context"):
        PrivilegedTeacherPolicy(None)
    with pytest.raises(TypeError, match="teacher Policy"):
        privileged_teacher_policy("hint", teacher=object())
    with pytest.raises(RuntimeError, match=r"no teacher policy yet: call NeMo-RL's setup\(\) inside"):
        privileged_teacher_policy("hint").get_topk_logits(_data(hint=[[1], [2]]), k=4)
    with pytest.raises(TypeError, match="takes a PrivilegedTeacherPolicy"):
        with privileged_teacher_in_setup("hint"):
            pass


@pytest.mark.parametrize("change,error,match", [
    ({}, ValueError, r"PrivilegedTeacherPolicy.get_topk_logits\(data\).*context='hint' and neither this batch "
                     r".* nor a rollout seen by privileged_teacher_in_setup"),
    ({"hint": [[1, 2]]}, ValueError, r"data\['hint'\] holds 1 contexts for a batch of 2 samples"),
    ({"hint": [[1, 2], None]}, ValueError, r"sample 1"),
])
def test_a_missing_context_is_refused_by_name_before_the_teachers_pass(change, error, match):
    teacher = Teacher()
    data = _data(**change)
    before = {key: value.clone() for key, value in data.items() if isinstance(value, torch.Tensor)}
    with pytest.raises(error, match=match):
        privileged_teacher_policy("hint", teacher=teacher).get_topk_logits(data, k=4)
    assert teacher.asked == [] and all(torch.equal(before[key], data[key]) for key in before)


def test_the_setup_block_builds_nemo_rls_teacher_and_delegates_its_residency():
    built = []

    def policy_class(*args, **kwargs):
        built.append(kwargs["name_prefix"])
        return Teacher()

    module = types.SimpleNamespace(Policy=policy_class)
    policy = privileged_teacher_policy("hint")
    with privileged_teacher_in_setup(policy, module=module):
        student = module.Policy(name_prefix="policy")
        assert module.Policy(name_prefix="teacher") is policy and built == ["policy", "teacher"]
    assert isinstance(student, Teacher) and isinstance(policy.teacher, Teacher) and policy.teacher is not student
    assert module.Policy is policy_class
    policy.prepare_for_lp_inference()
    policy.offload_after_refit()
    policy.offload_before_refit()
    assert policy.teacher.moves == ["prepare", "after", "before"] and student.moves == []
