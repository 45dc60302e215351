"""The live self-teacher in NeMo-RL (`self_teacher_policy(context=KEY)`, the entry `student;context=KEY`):
the student's own `Policy` scoring each sample's privileged context before its response, a
`TeacherPolicy` of the student's role (`teacher_policy`).

Its `get_topk_logits` is NeMo-RL's own no-grad top-k pass in the student's Megatron workers, with
the student's current weights (the rollout's, before its optimizer step), over context + the
student's response ids, its rows moved to the student's response positions. No copy of the
weights, no server, no weight sync; nothing is offloaded (the student's weights stay where NeMo-RL
keeps them). Apply `nemo_rl_topk` in the workers so `topk_logits` are log-probs over the whole
vocabulary (`nemo_rl_topk_kd` forms the exact tail from them).

`self_teacher_in_setup(policy)`: within the block NeMo-RL's `distillation.setup()` gets `policy`
as its teacher (`Policy(name_prefix="teacher", ...)` builds nothing) and the student's `Policy`
it builds is handed to `policy`; its rollouts keep each sample's context (`rollout_contexts`)."""
# lazy imports: optional dependency nemo_rl
from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

from megatron_rl_patches.integrations.nemo_rl.teacher_policy import Role, TeacherPolicy, policy_key, teacher_in_setup

SELF = Role(name="StudentPolicyPass", make="self_teacher_policy(context=KEY)",
            block="self_teacher_in_setup(policy)",
            who="student", prepares=True,
            no_context="the live self-teacher without a privileged context would be the student scoring itself "
                       "(every divergence zero); give it the batch field of each sample's context, e.g. "
                       "self_teacher_policy(context='solution')",
            hint="build it inside self_teacher_in_setup(policy) (NeMo-RL's distillation.setup() hands it the "
                 "student's Policy) or pass StudentPolicyPass(..., student=policy)")


class StudentPolicyPass(TeacherPolicy):
    """The live self-teacher's pass in NeMo-RL, nothing else: the teacher-policy calls handed to the
    student's own policy (`student`: NeMo-RL's `Policy`, or anything with its `get_topk_logits(data,
    k, micro_batch_size=None, timer=None)`; set by `self_teacher_in_setup` when None) over each
    sample's context under `context` (the batch field, ids or text through `tokenizer`, the
    student's) then its response. What it computes is `teachers.SelfTeacher`'s (the fused top-k
    head over the student's hidden states and output layer), inside the student's workers."""

    role = SELF

    def __init__(self, context: str, *, tokenizer: Any = None, student: Any = None) -> None:
        super().__init__(student, policy_key(SELF, context, student, "student"), tokenizer)

    student = property(TeacherPolicy.scoring_policy, doc="The student's `Policy` (None until `self_teacher_in_setup` "
                                                          "hands it over).")


def self_teacher_in_setup(policy: StudentPolicyPass, module: Any = None) -> AbstractContextManager[Any]:
    """`teacher_in_setup` for the live self-teacher: NeMo-RL's `setup()` gets `policy` as its teacher
    and hands it the student's `Policy` it builds; its rollouts keep each sample's context."""
    return teacher_in_setup(policy, module, SELF)


def self_teacher_policy(context: str, *, tokenizer: Any = None, student: Any = None) -> StudentPolicyPass:
    """NeMo-RL's live self-teacher (`student;context=KEY`): `StudentPolicyPass(context, tokenizer=...,
    student=...)`; use it inside `self_teacher_in_setup(policy)` around NeMo-RL's `setup()` and
    `distillation_train`."""
    return StudentPolicyPass(context, tokenizer=tokenizer, student=student)


