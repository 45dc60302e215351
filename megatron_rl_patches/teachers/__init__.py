"""Teachers beyond the training job, framework-free: the scores' shape inside a step
(`TeacherScores`), the contract of a teacher that scores whole samples (`TeacherBatch` ->
`BatchScores`: per response row the teacher's own top-k, their exact tail and the actual token's
log-prob), teachers served by an inference engine (`ServedTeacher`, vLLM; `served_buckets`: the
chunk-start buckets of one with another tokenizer from its top-k; `head_buckets`: exact, from its
hidden states through its head), a teacher's output layer on the
trainer (`TeacherHead`: a served teacher's hidden states through it), the teacher step of any loop
(`TeacherStep` behind a `TeacherHost`: send early, ask once per group, share, agree a failure; its
teachers built from entries through their kinds by `build_teachers`, every one at the step's
`ScoringPlan`: K or the whole vocabulary `VOCAB`, the temperature, the invariant mode), and the kinds of
teacher as one table (`teachers.kinds`: how an entry of MEGATRON_RL_PATCHES_OPD_TEACHERS is read
and checked), and teachers that see a privileged context the student does not (`with_context`: the
teacher's batch of context + the student's response per sample; `Privileged(teacher, KEY)`: any
teacher given a key; `context_ids`, `placed_before`;
`cross_with_context`: a teacher of another tokenizer's own samples after a context of its ids;
`SelfTeacher`: the live self-teacher, the student's own pass over them: its hidden states and
output layer, `StudentHidden`).
Importing this package is light (no torch, no HTTP client): names load on first use."""
from __future__ import annotations

from megatron_rl_patches._lazy import lazy_getattr, lazy_names

_LAZY = lazy_names("""
    scores: TeacherScores
    batch: TeacherBatch
    contract: BatchScores BatchTeacher
    megatron_rl_patches.teachers.served.client: ServedTeacher PendingScores
    megatron_rl_patches.teachers.served.settings: ClientSettings ReplicaSettings
    megatron_rl_patches.teachers.served.spreading: FewestInFlight PromptAffinity
    asynchronous: AsyncTeacher
    errors: ServedTeacherError ServedTeacherRefusal
    agreement: agree_failure
    tails: tail_log_probs
    cross_buckets: served_buckets ServedBuckets
    megatron_rl_patches.teachers.head.cross_buckets: head_buckets
    megatron_rl_patches.teachers.context.cross: cross_with_context
    megatron_rl_patches.teachers.head.teacher_head: TeacherHead
    megatron_rl_patches.teachers.step.teacher_step: TeacherStep StepPlan
    megatron_rl_patches.ops.scoring_plan: ScoringPlan VOCAB
    host: TeacherHost LoopHost megatron_host local_host
    build: build_teachers BuildOptions
    megatron_rl_patches.teachers.context.teacher_context: with_context context_ids placed_before
    megatron_rl_patches.teachers.context.privileged: Privileged
    self_teacher: SelfTeacher StudentHidden
""")

__all__ = sorted(_LAZY)

__getattr__ = lazy_getattr(__name__, _LAZY, globals())


def __dir__() -> list[str]:
    return __all__
