"""NeMo-RL's own teacher with a privileged context (`privileged_teacher_policy(context=KEY)`): the
teacher `Policy` NeMo-RL's `distillation.setup()` builds from the teacher's checkpoint (e.g. the
frozen initial weights θ₀) scoring each sample's context before its response.

`privileged_teacher_in_setup(policy)`: within the block `setup()`'s `Policy(name_prefix="teacher",
...)` is built as NeMo-RL builds it and handed to `policy`, which `setup()` returns as its teacher;
its rollouts keep each sample's context (`rollout_contexts`). `distillation_train`'s three calls:
`get_topk_logits` runs the teacher `Policy`'s own no-grad top-k pass over the privileged sequences
(the rows moved to the student's response positions, as the live self-teacher's),
`prepare_for_lp_inference` / `offload_after_refit` / `offload_before_refit` are the teacher
`Policy`'s own (its weights move as NeMo-RL moves them). Apply `nemo_rl_topk` in the teacher's
workers so `topk_logits` are log-probs over the whole vocabulary."""
# lazy imports: optional dependency nemo_rl
from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from typing import Any

from megatron_rl_patches.integrations.nemo_rl.privileged_topk import privileged_topk
from megatron_rl_patches.integrations.nemo_rl.rollout_contexts import ROLLOUTS, remembering
from megatron_rl_patches.teachers.context_key import context_key

WHERE = "PrivilegedTeacherPolicy.get_topk_logits(data)"


class PrivilegedTeacherPolicy:
    """NeMo-RL's teacher-policy calls answered by its own teacher `Policy` (`teacher`; set by
    `privileged_teacher_in_setup` when None) over each sample's context under `context` (the batch
    field, ids or text through `tokenizer`, the teacher's) then its response."""

    def __init__(self, context: str, *, tokenizer: Any = None, teacher: Any = None) -> None:
        key = context_key(context, "PrivilegedTeacherPolicy(context=...)")
        if key is None:
            raise ValueError("PrivilegedTeacherPolicy(context=None): without a privileged context this is NeMo-RL's "
                             "own teacher: use its Policy as it is, or give the batch field of each sample's "
                             "context, e.g. privileged_teacher_policy(context='solution')")
        if teacher is not None and not callable(getattr(teacher, "get_topk_logits", None)):
            raise TypeError(f"PrivilegedTeacherPolicy(teacher=...) must be NeMo-RL's teacher Policy (with "
                            f"get_topk_logits), got {type(teacher).__name__}")
        self.context: str = key
        self.tokenizer = tokenizer
        self.teacher = teacher
        self.rollout_values: list[Any] | None = None  # the last rollout batch's contexts (rollout_contexts)

    def __repr__(self) -> str:
        return f"PrivilegedTeacherPolicy(context={self.context!r})"

    def teacher_policy(self) -> Any:
        if self.teacher is None:
            raise RuntimeError("PrivilegedTeacherPolicy: no teacher policy yet: call NeMo-RL's setup() inside "
                               "privileged_teacher_in_setup(policy) (it hands over the teacher Policy setup() "
                               "builds) or pass PrivilegedTeacherPolicy(..., teacher=policy)")
        return self.teacher

    # ------------------------------------------------------------------ residency: the teacher Policy's own
    def prepare_for_lp_inference(self, *args: Any, **kwargs: Any) -> Any:
        return self.teacher_policy().prepare_for_lp_inference(*args, **kwargs)

    def offload_after_refit(self, *args: Any, **kwargs: Any) -> Any:
        return self.teacher_policy().offload_after_refit(*args, **kwargs)

    def offload_before_refit(self, *args: Any, **kwargs: Any) -> Any:
        return self.teacher_policy().offload_before_refit(*args, **kwargs)

    # ------------------------------------------------------------------ scoring
    def get_topk_logits(self, data: Any, k: int, micro_batch_size: int | None = None, timer: Any = None) -> Any:
        """`topk_logits` / `topk_indices` [B, S, k] at the student's positions (position s: the top-k
        predicting token s + 1), from the teacher Policy's own `get_topk_logits` over context +
        response; `data` untouched."""
        teacher = self.teacher_policy()
        values, self.rollout_values = self.rollout_values, None
        return privileged_topk(teacher, data, k, context=self.context, values=values, tokenizer=self.tokenizer,
                               where=WHERE, block="privileged_teacher_in_setup(policy)", who="teacher",
                               micro_batch_size=micro_batch_size, timer=timer)


@contextlib.contextmanager
def privileged_teacher_in_setup(policy: PrivilegedTeacherPolicy,
                                module: Any = None) -> Iterator[PrivilegedTeacherPolicy]:
    """Within the block NeMo-RL's `distillation.setup()` builds its teacher `Policy` as it does, hands
    it to `policy` and returns `policy` as the teacher; its rollouts keep each sample's context.
    Restored on exit."""
    if not isinstance(policy, PrivilegedTeacherPolicy):
        raise TypeError(f"privileged_teacher_in_setup(policy=...) takes a PrivilegedTeacherPolicy ("
                        f"privileged_teacher_policy(context=KEY)), got {type(policy).__name__}")
    if module is None:
        module = importlib.import_module("nemo_rl.algorithms.distillation")  # lazy: optional dependency nemo_rl
    original = module.Policy

    def build(*args: Any, **kwargs: Any) -> Any:
        built = original(*args, **kwargs)
        if kwargs.get("name_prefix") != "teacher":
            return built
        policy.teacher = built
        return policy

    def keep(values: list[Any]) -> None:
        policy.rollout_values = values

    rollouts = {name: getattr(module, name) for name in ROLLOUTS if hasattr(module, name)}
    module.Policy = build
    for name, rollout in rollouts.items():
        setattr(module, name, remembering(rollout, policy.context, keep))
    try:
        yield policy
    finally:
        module.Policy = original
        for name, rollout in rollouts.items():
            setattr(module, name, rollout)


def privileged_teacher_policy(context: str, *, tokenizer: Any = None, teacher: Any = None) -> PrivilegedTeacherPolicy:
    """NeMo-RL's own teacher over privileged contexts: `PrivilegedTeacherPolicy(context, tokenizer=...,
    teacher=...)`; use it inside `privileged_teacher_in_setup(policy)` around NeMo-RL's `setup()`
    and `distillation_train`."""
    return PrivilegedTeacherPolicy(context, tokenizer=tokenizer, teacher=teacher)
