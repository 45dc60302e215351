"""NeMo-RL's own teacher with a privileged context (`privileged_teacher_policy(context=KEY)`): the
teacher `Policy` NeMo-RL's `distillation.setup()` builds from the teacher's checkpoint (e.g. the
frozen initial weights θ₀) scoring each sample's context before its response, a `TeacherPolicy` of
the teacher's role (`teacher_policy`).

`privileged_teacher_in_setup(policy)`: within the block `setup()`'s `Policy(name_prefix="teacher",
...)` is built as NeMo-RL builds it and handed to `policy`, which `setup()` returns as its teacher;
its rollouts keep each sample's context (`rollout_contexts`). `get_topk_logits` runs the teacher
`Policy`'s own no-grad top-k pass over the privileged sequences (the rows moved to the student's
response positions, as the live self-teacher's); `prepare_for_lp_inference` /
`offload_after_refit` / `offload_before_refit` are the teacher `Policy`'s own (its weights move as
NeMo-RL moves them). Apply `nemo_rl_topk` in the teacher's workers so `topk_logits` are log-probs
over the whole vocabulary."""
# lazy imports: optional dependency nemo_rl
from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

from megatron_rl_patches.integrations.nemo_rl.teacher_policy import Role, TeacherPolicy, policy_key, teacher_in_setup

PRIVILEGED = Role(name="PrivilegedTeacherPolicy", make="privileged_teacher_policy(context=KEY)",
                  block="privileged_teacher_in_setup(policy)", who="teacher", prepares=True,
                  offloads=True, builds_teacher=True,
                  no_context="without a privileged context this is NeMo-RL's own teacher: use its Policy as it is, "
                             "or give the batch field of each sample's context, e.g. "
                             "privileged_teacher_policy(context='solution')",
                  hint="call NeMo-RL's setup() inside privileged_teacher_in_setup(policy) (it hands over the teacher "
                       "Policy setup() builds) or pass PrivilegedTeacherPolicy(..., teacher=policy)")


class PrivilegedTeacherPolicy(TeacherPolicy):
    """NeMo-RL's teacher-policy calls answered by its own teacher `Policy` (`teacher`; set by
    `privileged_teacher_in_setup` when None) over each sample's context under `context` (the batch
    field, ids or text through `tokenizer`, the teacher's) then its response."""

    role = PRIVILEGED

    def __init__(self, context: str, *, tokenizer: Any = None, teacher: Any = None) -> None:
        super().__init__(teacher, policy_key(PRIVILEGED, context, teacher, "teacher"), tokenizer)

    teacher = property(TeacherPolicy.scoring_policy, doc="NeMo-RL's teacher `Policy` (None until "
                                                          "`privileged_teacher_in_setup` hands it over).")


def privileged_teacher_in_setup(policy: PrivilegedTeacherPolicy, module: Any = None) -> AbstractContextManager[Any]:
    """`teacher_in_setup` for NeMo-RL's own teacher: `setup()` builds its teacher `Policy` as it does,
    hands it to `policy` and returns `policy` as the teacher; its rollouts keep each sample's context."""
    return teacher_in_setup(policy, module, PRIVILEGED)


def privileged_teacher_policy(context: str, *, tokenizer: Any = None, teacher: Any = None) -> PrivilegedTeacherPolicy:
    """NeMo-RL's own teacher over privileged contexts: `PrivilegedTeacherPolicy(context, tokenizer=...,
    teacher=...)`; use it inside `privileged_teacher_in_setup(policy)` around NeMo-RL's `setup()`
    and `distillation_train`."""
    return PrivilegedTeacherPolicy(context, tokenizer=tokenizer, teacher=teacher)
