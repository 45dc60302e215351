"""The plan of one slime step on the fused route, shared by `fused` (which runs it) and `opd`
(which asks it for top-k buckets): what the fused model call needs (`StepPlan`, `TopkRequest`),
the data iterators that carry the plan through slime's step (`planned`, `plan_of`) to the batch
the loss reads it from (`PLAN`, `plan_in`), and the rollout-data keys top-k OPD adds with the
request its training step makes (`step_request`).

slime's callbacks have fixed signatures (`get_batch(data_iterator, keys, ...)`, the schedule's
`forward_step_func(data_iterator, model)`, the loss `func(args, batch, logits, ...)`), so the plan
travels with the data slime hands them: the iterators a planned call passes on, and the batch
`get_batch` returns (under the key `PLAN`)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from megatron_rl_patches.integrations.megatron.teachers.opd_settings import LOSS_PATHS, OpdSettings, opd_settings


@dataclass(frozen=True)
class TopkRequest:
    """Top-k buckets asked of the fused call beside the log-probs: the student's own top-`k` ids,
    or the ids in the batch's per-sample `ids_key` ([R, k] each) scored (padded where the
    per-sample bool `mask_key` is False), or with `union` its own top-`k` joined to those ids
    (`union_ids`); `keys` are the per-sample batch keys the step needs beyond slime's own."""

    k: int | None = None
    ids_key: str | None = None
    keys: tuple[str, ...] = ()
    mask_key: str | None = None
    union: bool = False


@dataclass
class StepPlan:
    """What the fused model call of one slime step needs: slime's args, whether entropy is wanted
    (and its gradient), top-k buckets if asked, and the micro-batch `get_batch` returned last.
    `fused=False`: a step on slime's own logits path that still fetches the request's batch keys.
    `invariant`: the student's invariant mode, resolved once where the step is handed the model
    (None: the ops resolve their own); `settings`: top-k OPD's, parsed once for the step (None: off)."""

    args: Any
    with_entropy: bool
    entropy_requires_grad: bool
    topk: TopkRequest | None = None
    batch: dict | None = field(default=None, repr=False)
    fused: bool = True
    invariant: bool | None = None
    settings: OpdSettings | None = field(default=None, repr=False)


# The per-sample keys top-k OPD adds to slime's rollout data: the ids scored ([R, k], or [R, 2k]
# with their padding mask for a union), and per teacher the scores [n, R, k] and tails [n, R].
IDS, TEACHER_LOGPROBS, TEACHER_TAILS = "opd_topk_ids", "opd_teacher_logprobs", "opd_teacher_tails"
IDS_MASK = "opd_topk_ids_mask"
# Teachers with another tokenizer (`cross_passes`): per sample, the ids the student's step scores (the
# same-tokenizer ids, then each such teacher's bucket ids; [R, K] with their mask), and per such
# teacher the token-level log-ratio [R, n], bucket scores [R, n, k], tails [R, n], live buckets [R, n, k].
STEP_IDS, STEP_MASK = "opd_step_ids", "opd_step_ids_mask"
# per sample [R, K] int64: a slot whose id an earlier slot of its row holds, that column (else -1;
# `step_repeats`: scored once, masked in STEP_MASK)
STEP_SAME_AS = "opd_step_same_as"
CROSS_RATIO, CROSS_LOGPROBS = "opd_cross_log_ratio", "opd_cross_teacher_logprobs"
CROSS_TAILS, CROSS_ALIVE = "opd_cross_teacher_tails", "opd_cross_alive"
# per sample [n] int64 on the host: the places in MEGATRON_RL_PATCHES_OPD_TEACHERS of the teachers
# whose buckets are grouped (another tokenizer), in the order of the CROSS_* fields' columns
CROSS_TEACHERS = "opd_cross_teachers"
CROSS_KEYS = (STEP_IDS, STEP_MASK, STEP_SAME_AS, CROSS_RATIO, CROSS_LOGPROBS, CROSS_TAILS, CROSS_ALIVE, CROSS_TEACHERS)
OPD_KEYS = (IDS, IDS_MASK, TEACHER_LOGPROBS, TEACHER_TAILS, *CROSS_KEYS)
STEP_REQUEST = TopkRequest(ids_key=IDS, keys=(IDS, TEACHER_LOGPROBS, TEACHER_TAILS))
UNION_STEP_REQUEST = TopkRequest(ids_key=IDS, mask_key=IDS_MASK, keys=(IDS, IDS_MASK, TEACHER_LOGPROBS, TEACHER_TAILS))

# Full-vocabulary OPD (MEGATRON_RL_PATCHES_OPD_K=vocab, `vocab_opd`): per sample a tuple with each
# teacher's final hidden states [R, H_j] on this rank's response rows (slime's zigzag rows), and the
# teachers' output layers (`vocab_step.TeacherHeads`, the same object for every sample: a reference).
TEACHER_HIDDEN, TEACHER_HEADS = "opd_teacher_hidden", "opd_teacher_heads"
VOCAB_KEYS = (TEACHER_HIDDEN, TEACHER_HEADS)


@dataclass(frozen=True)
class VocabRequest(TopkRequest):
    """Full-vocabulary OPD's part of a fused call (`vocab_step`). `hidden`: a teacher's pass giving
    its final hidden states (its output weight kept once per pass in `captured`); else the training
    step's: the per-token `divergence` between the student and the teachers of the batch's keys,
    mixed with `weights` (None: equal)."""

    hidden: bool = False
    divergence: str = "reverse_kl"
    weights: tuple[float, ...] | None = None
    captured: list = field(default_factory=list, compare=False, hash=False, repr=False)


# the batch key under which a planned `get_batch` hands the loss its step's plan
PLAN = "megatron_rl_patches_step_plan"


class PlannedIterator:
    """One of slime's data iterators with the plan of the step it feeds: `get_next`, `reset` and
    every other attribute are the iterator's own."""

    def __init__(self, iterator: Any, plan: StepPlan):
        self.iterator, self.plan = iterator, plan

    def __getattr__(self, name: str) -> Any:
        if name in ("iterator", "plan"):  # not set yet (a copy being built): no recursion through the wrapped one
            raise AttributeError(name)
        return getattr(self.iterator, name)


def planned(iterators: Any, plan: StepPlan | None) -> Any:
    """slime's data iterator(s) (one, or a list: one per virtual stage) carrying `plan` (None: as
    given)."""
    if plan is None or iterators is None:
        return iterators
    if isinstance(iterators, Sequence):
        return [PlannedIterator(iterator, plan) for iterator in iterators]
    return PlannedIterator(iterators, plan)


def plan_of(iterators: Any) -> StepPlan | None:
    """The plan a data iterator (or the first of a list) carries; None for slime's own."""
    if isinstance(iterators, Sequence) and not isinstance(iterators, (str, bytes)):
        iterators = iterators[0] if len(iterators) else None
    return iterators.plan if isinstance(iterators, PlannedIterator) else None


def plan_in(batch: Any) -> StepPlan | None:
    """The plan a planned `get_batch` put in its micro-batch (None: a batch of slime's own)."""
    return batch.get(PLAN) if isinstance(batch, dict) else None


def step_request(args: Any, settings: OpdSettings | None = None) -> TopkRequest | None:
    """The top-k request of slime's training step: the student scores the rollout's ids (with
    their padding mask for a union) when top-k OPD is on (`settings`: the step's, parsed once;
    None: read from the environment here) and slime's loss is top-k OPD's."""
    if settings is None:
        settings = opd_settings()
    if settings is None or getattr(args, "custom_loss_function_path", None) not in LOSS_PATHS:
        return None
    if getattr(args, "loss_type", None) != "custom_loss":
        return None
    if settings.full_vocab:  # the divergence over the whole vocabulary from the teachers' hidden states
        return VocabRequest(keys=VOCAB_KEYS, divergence=settings.divergence, weights=settings.weights)
    if any(teacher.other_tokenizer for teacher in settings.teachers):  # grouped buckets: the cross keys
        return TopkRequest(ids_key=STEP_IDS, mask_key=STEP_MASK, keys=(*UNION_STEP_REQUEST.keys, *CROSS_KEYS))
    return UNION_STEP_REQUEST if settings.ids_from == "union" else STEP_REQUEST
