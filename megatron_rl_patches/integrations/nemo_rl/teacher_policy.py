"""NeMo-RL's distillation teacher as one policy (`TeacherPolicy`), whose scorer is data (`Role`):

- served (`ServedTeacherPolicy`): a `ServedTeacher` asked from NeMo-RL's driver; nothing of the
  teacher on the job's GPUs, so nothing to prepare or offload;
- NeMo-RL's own teacher `Policy` (`PrivilegedTeacherPolicy`): the `Policy` its `setup()` builds,
  handed over; its residency its own;
- the student's `Policy` (`StudentPolicyPass`, the live self-teacher): NeMo-RL's own no-grad top-k
  pass with the student's current weights; it prepares as the student does and offloads nothing
  (the student trains next).

NeMo-RL 7ea279ab's `distillation_train` asks its teacher `prepare_for_lp_inference()`,
`get_topk_logits(data, k=topk_logits_k, ...)` and `offload_after_refit()`. With a context key
(the policy's own: the one owner of its key) the teacher scores each sample's context (NeMo-RL's
batch field KEY, else the last rollout's, `rollout_contexts`) before its response
(`context_fields.privileged_batch`), its rows placed at the student's response positions.

`teacher_in_setup(policy)` is the one setup block: within it NeMo-RL's `distillation.setup()` gets
`policy` as its teacher (`Policy(name_prefix="teacher", ...)`), hands it the `Policy` its role
wraps, and its rollouts keep each sample's context."""
# lazy imports: optional dependency nemo_rl
from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from megatron_rl_patches.integrations.context_fields import privileged_batch, tokenizer_vocab
from megatron_rl_patches.integrations.nemo_rl.rollout_contexts import ROLLOUTS, remembering
from megatron_rl_patches.integrations.nemo_rl.teacher_rows import nemo_rl_data, placed_topk, student_batch
from megatron_rl_patches.teachers.batch import TeacherBatch
from megatron_rl_patches.teachers.context.key import context_key


@dataclass(frozen=True)
class Role:
    """Whose scorer a `TeacherPolicy` wraps and the words its messages use: `name` (the public
    class), `make` (the function users call), `block` (its setup block's name), `who` (whose
    `Policy`: "teacher" or "student"; "served" for a served teacher, asked in the driver), `hint`
    (what a policy without its scorer is told), `no_context` (why it needs a context key),
    `prepares` / `offloads` (whether those calls are its `Policy`'s own), `builds_teacher`
    (NeMo-RL's teacher `Policy`, built by `setup()` and handed over)."""

    name: str
    make: str
    block: str
    who: str
    hint: str
    no_context: str = ""
    prepares: bool = False
    offloads: bool = False
    builds_teacher: bool = False

    @property
    def where(self) -> str:
        return f"{self.name}.get_topk_logits(data)"


def policy_key(role: Role, context: Any, scorer: Any, argument: str) -> str:
    """The context key of a policy of `role` that must have one, its `Policy` (`argument`, None
    until its setup block hands it over) checked to be NeMo-RL's: ValueError / TypeError naming them."""
    key = context_key(context, f"{role.name}(context=...)")
    if key is None:
        raise ValueError(f"{role.name}(context=None): {role.no_context}")
    if scorer is not None and not callable(getattr(scorer, "get_topk_logits", None)):
        raise TypeError(f"{role.name}({argument}=...) must be NeMo-RL's {role.who} Policy (with get_topk_logits), "
                        f"got {type(scorer).__name__}")
    return key


class TeacherPolicy:
    """NeMo-RL's teacher-policy calls answered by the scorer `role` names (`scorer`: a
    `ServedTeacher`, or NeMo-RL's `Policy`, set by `teacher_in_setup` when None), over each
    sample's context under `context` (ids, or text through `tokenizer`, the teacher's) then its
    response; without a context, over the batch as NeMo-RL sends it (a served teacher only)."""

    role: Role

    def __init__(self, scorer: Any, context: str | None, tokenizer: Any) -> None:
        self.scorer = scorer
        self.context = context
        self.tokenizer = tokenizer
        self.rollout_values: list[Any] | None = None  # the last rollout batch's contexts (rollout_contexts)

    def __repr__(self) -> str:
        return f"{self.role.name}(context={self.context!r})"

    def scoring_policy(self) -> Any:
        """The scorer as it is (None until `teacher_in_setup` hands it over)."""
        return self.scorer

    def scoring(self) -> Any:
        """The scorer, or a RuntimeError saying where it comes from."""
        if self.scorer is None:
            raise RuntimeError(f"{self.role.name}: no {self.role.who} policy yet: {self.role.hint}")
        return self.scorer

    # ------------------------------------------------------------------ residency: the role's
    def prepare_for_lp_inference(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped `Policy`'s own preparation for its top-k pass (a served teacher: nothing)."""
        return self.scoring().prepare_for_lp_inference(*args, **kwargs) if self.role.prepares else None

    def offload_after_refit(self, *args: Any, **kwargs: Any) -> Any:
        """NeMo-RL's teacher `Policy`'s own offload; nothing for the others (no teacher weights on
        the job's GPUs, or the student's, which trains next)."""
        return self.scoring().offload_after_refit(*args, **kwargs) if self.role.offloads else None

    def offload_before_refit(self, *args: Any, **kwargs: Any) -> Any:
        return self.scoring().offload_before_refit(*args, **kwargs) if self.role.offloads else None

    # ------------------------------------------------------------------ scoring
    def get_topk_logits(self, data: Any, k: int, micro_batch_size: int | None = None, timer: Any = None) -> Any:
        """`topk_logits` / `topk_indices` [B, S, k] at the student's positions (position s: the top-k
        predicting token s + 1), from the wrapped `Policy`'s own `get_topk_logits` over each
        sample's context then its response (bad contexts refused before it runs), as NeMo-RL's
        `BatchedDataDict`; `data` untouched."""
        scorer = self.scoring()
        batch, shape = student_batch(data, self.role.where)
        assert self.context is not None  # a Policy's role requires one
        scored = self.privileged(batch, data, self.context)
        from nemo_rl.distributed.batched_data_dict import BatchedDataDict  # lazy: optional dependency nemo_rl

        got = scorer.get_topk_logits(BatchedDataDict(nemo_rl_data(scored)), k=k, micro_batch_size=micro_batch_size,
                                     timer=timer)
        values, ids = placed_topk(got, batch, scored, shape, int(k), f"{self.role.where}: the {self.role.who}'s")
        return BatchedDataDict({"topk_logits": values, "topk_indices": ids})

    def context_vocab(self) -> int | None:
        """The vocabulary a context's ids are checked against: the named tokenizer's (None: none)."""
        return tokenizer_vocab(self.tokenizer)

    def privileged(self, batch: TeacherBatch, data: Any, key: str) -> TeacherBatch:
        """The teacher's batch: each sample's context (the batch field `key`, else the last
        rollout's, used once) then its response ids."""
        values, self.rollout_values = self.rollout_values, None
        values = data[key] if key in data else values
        if values is None:
            raise ValueError(f"{self.role.where}: the teacher has context={key!r} and neither this batch (it has "
                             f"{sorted(map(str, data))}) nor a rollout seen by {self.role.block} holds the field: "
                             f"run distillation_train inside the {self.role.block} block (its rollouts read each "
                             f"sample's field {key!r} or extra_env_info[{key!r}])")
        return privileged_batch(batch, values, key, self.role.where, self.tokenizer, self.context_vocab())

    # ------------------------------------------------------------------ setup: NeMo-RL's names, this role's
    def teacher_built(self, build: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """What `distillation.Policy(*args, **kwargs)` gives inside the setup block: this policy for
        the teacher (NeMo-RL's teacher `Policy` built first and handed over when the role wraps it),
        NeMo-RL's `Policy` for every other (the student's handed over when the role wraps it)."""
        if kwargs.get("name_prefix") != "teacher":
            built = build(*args, **kwargs)
            if self.role.who == "student":
                self.scorer = built
            return built
        if self.role.builds_teacher:
            self.scorer = build(*args, **kwargs)
        return self

    def setup_names(self, module: Any) -> dict[str, Any]:
        """Further names of NeMo-RL's distillation module the role answers in the setup block."""
        return {}


@contextlib.contextmanager
def teacher_in_setup(policy: TeacherPolicy, module: Any = None, role: Role | None = None) -> Iterator[Any]:
    """Within the block NeMo-RL's `distillation.setup()` gets `policy` as its teacher (the name
    `Policy` in `module`, default `nemo_rl.algorithms.distillation`, answered by
    `policy.teacher_built`; further names by `policy.setup_names`) and, with a context key, its
    rollouts keep each sample's context. Restored on exit. `role`: the role the caller's block
    takes (another policy refused, naming it)."""
    role = role or getattr(policy, "role", None)
    if not isinstance(policy, TeacherPolicy) or role is None or policy.role is not role:
        shown = type(policy).__name__
        name = role.name if role is not None else "TeacherPolicy"
        block = role.block.split("(")[0] if role is not None else "teacher_in_setup"
        making = f" ({role.make})" if role is not None else ""
        raise TypeError(f"{block}(policy=...) takes a {name}{making}, got {shown}")
    if module is None:
        module = importlib.import_module("nemo_rl.algorithms.distillation")  # lazy: optional dependency nemo_rl
    original = module.Policy

    def build(*args: Any, **kwargs: Any) -> Any:
        return policy.teacher_built(original, args, kwargs)

    def keep(values: list[Any]) -> None:
        policy.rollout_values = values

    key = policy.context
    names = {"Policy": build, **policy.setup_names(module)}
    names.update({name: remembering(getattr(module, name), key, keep, role.name) for name in ROLLOUTS
                  if key is not None and hasattr(module, name)})
    saved = {name: getattr(module, name, None) for name in names}
    for name, value in names.items():
        setattr(module, name, value)
    try:
        yield policy
    finally:
        for name, value in saved.items():
            setattr(module, name, value)
