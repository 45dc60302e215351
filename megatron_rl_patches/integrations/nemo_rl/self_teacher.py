"""The live self-teacher in NeMo-RL (`self_teacher_policy(context=KEY)`, the entry `student;context=KEY`):
the student's own policy scoring each sample's privileged context before its response.

NeMo-RL 7ea279ab's `distillation_train` asks its teacher `prepare_for_lp_inference()`,
`get_topk_logits(data, k=topk_logits_k, ...)` and `offload_after_refit()`. `SelfTeacherPolicy`
answers them with the student's `Policy`: its `get_topk_logits` (NeMo-RL's own no-grad top-k pass
in the student's Megatron workers, with the student's current weights: the rollout's, before its
optimizer step) over the privileged sequences (context + the student's response ids, NeMo-RL's
layout: `input_ids` right-padded, `input_lengths`, `token_mask` on the response), its rows moved
to the student's response positions. No copy of the weights, no server, no weight sync; nothing
is offloaded (the student's weights stay where NeMo-RL keeps them). Apply `nemo_rl_topk` in the
workers so `topk_logits` are log-probs over the whole vocabulary (`nemo_rl_topk_kd` forms the
exact tail from them); NeMo-RL's own processor gives raw logits, which its own loss renormalizes.

`self_teacher_in_setup(policy)`: within the block NeMo-RL's `distillation.setup()` gets `policy`
as its teacher (`Policy(name_prefix="teacher", ...)` builds nothing) and the student's `Policy`
it builds is handed to `policy`; its rollouts keep each sample's context (`rollout_contexts`)."""
# lazy imports: optional dependency nemo_rl
from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from typing import Any

from megatron_rl_patches.integrations.nemo_rl.privileged_topk import privileged_topk
from megatron_rl_patches.integrations.nemo_rl.rollout_contexts import ROLLOUTS, remembering
from megatron_rl_patches.teachers.context_key import context_key

WHERE = "SelfTeacherPolicy.get_topk_logits(data)"


class SelfTeacherPolicy:
    """NeMo-RL's teacher-policy calls answered by the student's own policy (`student`: NeMo-RL's
    `Policy`, or anything with its `get_topk_logits(data, k, micro_batch_size=None, timer=None)`;
    set by `self_teacher_in_setup` when None) over each sample's context under `context` (the
    batch field, ids or text through `tokenizer`, the student's) then its response."""

    def __init__(self, context: str, *, tokenizer: Any = None, student: Any = None) -> None:
        key = context_key(context, "SelfTeacherPolicy(context=...)")
        if key is None:
            raise ValueError("SelfTeacherPolicy(context=None): the live self-teacher without a privileged context "
                             "would be the student scoring itself (every divergence zero); give it the batch field "
                             "of each sample's context, e.g. self_teacher_policy(context='solution')")
        if student is not None and not callable(getattr(student, "get_topk_logits", None)):
            raise TypeError(f"SelfTeacherPolicy(student=...) must be NeMo-RL's student Policy (with get_topk_logits), "
                            f"got {type(student).__name__}")
        self.context: str = key
        self.tokenizer = tokenizer
        self.student = student
        self.rollout_values: list[Any] | None = None  # the last rollout batch's contexts (rollout_contexts)

    def __repr__(self) -> str:
        return f"SelfTeacherPolicy(context={self.context!r})"

    def student_policy(self) -> Any:
        if self.student is None:
            raise RuntimeError("SelfTeacherPolicy: no student policy yet: build it inside self_teacher_in_setup("
                               "policy) (NeMo-RL's distillation.setup() hands it the student's Policy) or pass "
                               "SelfTeacherPolicy(..., student=policy)")
        return self.student

    # ------------------------------------------------------------------ residency: the student's own
    def prepare_for_lp_inference(self, *args: Any, **kwargs: Any) -> None:
        """The student's own preparation for its log-prob pass."""
        self.student_policy().prepare_for_lp_inference(*args, **kwargs)

    def offload_after_refit(self, *args: Any, **kwargs: Any) -> None:
        """Nothing: the student's weights stay where NeMo-RL keeps them (it trains next)."""

    def offload_before_refit(self, *args: Any, **kwargs: Any) -> None:
        """Nothing: the student's weights stay where NeMo-RL keeps them."""

    # ------------------------------------------------------------------ scoring
    def get_topk_logits(self, data: Any, k: int, micro_batch_size: int | None = None, timer: Any = None) -> Any:
        """`topk_logits` / `topk_indices` [B, S, k] at the student's positions (position s: the top-k
        predicting token s + 1; the student's pass over context + response), from the student's own
        `get_topk_logits` on the privileged batch; `data` untouched."""
        student = self.student_policy()
        values, self.rollout_values = self.rollout_values, None
        return privileged_topk(student, data, k, context=self.context, values=values, tokenizer=self.tokenizer,
                               where=WHERE, block="self_teacher_in_setup(policy)", who="student",
                               micro_batch_size=micro_batch_size, timer=timer)


@contextlib.contextmanager
def self_teacher_in_setup(policy: SelfTeacherPolicy, module: Any = None) -> Iterator[SelfTeacherPolicy]:
    """Within the block NeMo-RL's `distillation.setup()` gets `policy` as its teacher and hands it the
    student's `Policy` it builds; its rollouts keep each sample's context. Restored on exit."""
    if not isinstance(policy, SelfTeacherPolicy):
        raise TypeError(f"self_teacher_in_setup(policy=...) takes a SelfTeacherPolicy (self_teacher_policy(context="
                        f"KEY)), got {type(policy).__name__}")
    if module is None:
        module = importlib.import_module("nemo_rl.algorithms.distillation")  # lazy: optional dependency nemo_rl
    original = module.Policy

    def build(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("name_prefix") == "teacher":
            return policy
        built = original(*args, **kwargs)
        policy.student = built
        return built

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


def self_teacher_policy(context: str, *, tokenizer: Any = None, student: Any = None) -> SelfTeacherPolicy:
    """NeMo-RL's live self-teacher (`student;context=KEY`): `SelfTeacherPolicy(context, tokenizer=...,
    student=...)`; use it inside `self_teacher_in_setup(policy)` around NeMo-RL's `setup()` and
    `distillation_train`."""
    return SelfTeacherPolicy(context, tokenizer=tokenizer, student=student)


