"""The live self-teacher (`SelfTeacher`, entry `student;context=KEY`): the student's current
weights scoring the privileged sequences (`with_context`), through the host's own pass of the
student's model (`LoopHost(student_pass=...)`): no copy of the weights, no server, no weight sync.
The pass runs under `torch.no_grad()` and returns the student's final hidden states on the
response rows and its output layer's weight (`StudentHidden`), never logits: the scores come from
the fused head's ops (`teachers.head.own_scores`, the served head route's computation too:
vocabulary tiles, no [R, V] logits on any rank). Nothing is differentiated: no gradient flows
through the teacher's side. Its scores are the student's whole distribution on each row at the
step's `ScoringPlan`: its own top-k, the exact tail (the mass of every id outside them) and the
actual token's log-prob, float64.

At tensor parallelism (`tp_group`: the host's) the pass returns whole hidden rows on every rank
of the group (sequence parallelism gathered: [R_i, H], cheap beside the logits) and this rank's
shard of the output weight ([V_local, H], Megatron's padding included): the scores are computed
vocab-parallel, the same on every rank of the group. Each rank's shape check is agreed over the
group before the ops' first collective (one rank's bad pass is the same error on every rank).
slime's and NeMo-RL's live self-teachers are this computation inside their output processor
(`topk_output_processor` in the student's own forward); their adapters only supply that pass."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from megatron_rl_patches.ops.scoring_plan import Planned, ScoringPlan, positive_int, scoring_plan
from megatron_rl_patches.teachers.agreement import agree_failure, distributed
from megatron_rl_patches.teachers.batch import TeacherBatch
from megatron_rl_patches.teachers.context.key import context_key
from megatron_rl_patches.teachers.contract import BatchScores
from megatron_rl_patches.teachers.head.own_scores import own_scores

LARGEST_ID = 2**63 - 1  # token ids are int64


@dataclass(frozen=True)
class StudentHidden:
    """What the host's pass returns: per sample the student's final hidden states on its response
    rows (`hidden[i]` [R_i, H], after the final norm: what the output layer takes; row r the state
    that predicts token response_start + r) and the output layer's weight `output_weight` [V', H]
    (V' >= the student's vocabulary: padding cut; at tensor parallelism this rank's shard
    [V_local, H]), in the hidden states' dtype."""

    hidden: Sequence[torch.Tensor]
    output_weight: torch.Tensor


# (the teacher's TeacherBatch) -> the student's hidden states on its response rows and output weight
StudentPass = Callable[[TeacherBatch], StudentHidden]


class SelfTeacher(Planned):
    """The student scoring `context + its own response` with its current weights: `student_pass`
    the host's pass (see `StudentPass`: hidden states and output weight, no logits), `vocab_size`
    the student's real vocabulary, `plan` the step's `ScoringPlan` (or, written the short way,
    `top_k` its buckets per row and `temperature` the step's), `context` the key of its privileged
    contexts (required: without one it would be the student scoring itself). `tp_group`: the
    student's tensor-parallel group when the pass returns this rank's shard of the output weight
    (None: the whole weight), and `padded_vocab_size` the rows of its output layer over that group
    (None: not checked)."""

    def __init__(self, student_pass: StudentPass, vocab_size: int, top_k: int | None = None, *, context: str,
                 temperature: float | None = None, tp_group: Any = None, padded_vocab_size: int | None = None,
                 plan: ScoringPlan | None = None) -> None:
        if not callable(student_pass):
            raise TypeError(f"SelfTeacher(student_pass=...) must be the host's pass of the student's model, a "
                            f"callable (TeacherBatch) -> StudentHidden(hidden=[R_i, H] per sample, output_weight="
                            f"[V, H]), got {type(student_pass).__name__}")
        key = context_key(context, "SelfTeacher(context=...)")
        if key is None:
            raise ValueError("SelfTeacher(context=None): the live self-teacher without a privileged context would be "
                             "the student scoring itself (every divergence zero); give it the key of each sample's "
                             "context, e.g. 'student;context=solution'")
        self.student_pass = student_pass
        self.vocab_size = positive_int("SelfTeacher(vocab_size=...)", vocab_size, " (the student's real vocabulary)")
        if self.vocab_size > LARGEST_ID + 1:
            raise ValueError(f"SelfTeacher(vocab_size={vocab_size!r:.40}…) is past any vocabulary: a token id is an "
                             f"int64 (at most 2**63 - 1)")
        self.plan = scoring_plan(plan, top_k, temperature, "SelfTeacher")
        if self.plan.k >= self.vocab_size:
            raise ValueError(f"SelfTeacher(top_k={self.plan.k}) must be below the student's vocabulary of "
                             f"{vocab_size}: the tail (every id outside the top-k) holds at least one")
        self.context: str = key
        self.tp_group = tp_group
        if padded_vocab_size is not None and (isinstance(padded_vocab_size, bool) or not isinstance(
                padded_vocab_size, int) or padded_vocab_size < self.vocab_size):
            raise ValueError(f"SelfTeacher(padded_vocab_size={padded_vocab_size!r}): the rows of the student's output "
                             f"layer over its tensor-parallel group, an int >= vocab_size ({vocab_size}), or None")
        self.padded_vocab_size = padded_vocab_size

    def __repr__(self) -> str:
        return f"SelfTeacher(context={self.context!r}, top_k={self.top_k})"

    def score(self, batch: TeacherBatch) -> BatchScores:
        """Every sample's response rows scored by the student's current weights (no grad)."""
        if not isinstance(batch, TeacherBatch):
            raise TypeError(f"SelfTeacher.score(batch) takes a TeacherBatch, got {type(batch).__name__}")
        with torch.no_grad():
            given = self.student_pass(batch)
        error: Exception | None = None
        try:
            self.check_pass(given, batch)
        except ValueError as refused:
            error = refused
        if self.shards() > 1:  # every rank's check before the ops' first collective
            agree_failure(error, self.tp_group, own=True)
        elif error is not None:
            raise error
        rows = [batch.response_rows(i) for i in range(len(batch))]
        if not sum(rows):  # the same batch on every rank of the group: none runs a collective
            empty = [torch.zeros(n, dtype=torch.float64) for n in rows]
            return BatchScores(empty, [torch.zeros(n, self.plan.k, dtype=torch.int64) for n in rows],
                               [torch.zeros(n, self.plan.k, dtype=torch.float64) for n in rows], list(empty))
        weight = given.output_weight.detach()
        hidden = torch.cat([one.detach() for one in given.hidden]).to(weight.device)
        tokens = torch.cat([s[start:] for s, start in zip(batch.sequences, batch.response_starts)]).long()
        group = self.tp_group if self.shards() > 1 else None
        token, ids, values, tail = own_scores(hidden, weight, tokens.to(hidden.device), self.plan.k,
                                              temperature=self.temperature, tp_group=group,
                                              vocab_size=self.vocab_size, invariant=self.invariant)
        return BatchScores(*(list(part.cpu().split(rows)) for part in (token, ids, values, tail)))

    def shards(self) -> int:
        """The tensor-parallel size the output weight is split over (1: the whole weight)."""
        if self.tp_group is None or not distributed():
            return 1
        import torch.distributed as dist  # lazy: import cost: torch.distributed only with a group

        return dist.get_world_size(self.tp_group)

    def check_pass(self, given: Any, batch: TeacherBatch) -> None:
        """ValueError naming what the pass returned where it is not a `StudentHidden` of the batch's
        response rows of hidden states and an output weight over the student's vocabulary (this
        rank's shard of it at tensor parallelism)."""
        if not isinstance(given, StudentHidden):
            raise ValueError(f"SelfTeacher: the host's student_pass returned {type(given).__name__}: return "
                             "StudentHidden(hidden=[R_i, H] per sample, output_weight=[V, H]) (the student's final "
                             "hidden states and output layer's weight, never logits)")
        weight, shards, padded = given.output_weight, self.shards(), self.padded_vocab_size
        local = padded // shards if padded is not None and shards > 1 else None
        if not (isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.shape[0] * shards >= self.vocab_size
                and (local is None or weight.shape[0] == local)):
            shown = str(tuple(weight.shape)) if isinstance(weight, torch.Tensor) else type(weight).__name__
            wanted = (f"[V >= {self.vocab_size}, H]" if shards == 1 else
                      f"[{local if local is not None else 'V_local'}, H] (this rank's shard of the output layer at "
                      f"tensor-parallel size {shards}: not gathered)")
            raise ValueError(f"SelfTeacher: the host's student_pass returned an output_weight of {shown}: expected "
                             f"the student's output layer over its {self.vocab_size} ids {wanted}")
        if len(given.hidden) != len(batch):
            raise ValueError(f"SelfTeacher: the host's student_pass returned {len(given.hidden)} hidden-state tensors "
                             f"for a batch of {len(batch)} samples: return one [R_i, H] tensor per sample")
        for sample, one in enumerate(given.hidden):
            count = batch.response_rows(sample)
            if not (isinstance(one, torch.Tensor) and one.dim() == 2 and one.shape[0] == count
                    and one.shape[1] == weight.shape[1] and one.dtype == weight.dtype):
                shown = f"{tuple(one.shape)} {one.dtype}" if isinstance(one, torch.Tensor) else type(one).__name__
                raise ValueError(f"SelfTeacher: the host's student_pass returned hidden states {shown} for sample "
                                 f"{sample}: expected its {count} response rows [{count}, {weight.shape[1]}] in the "
                                 f"output weight's dtype {weight.dtype} (whole rows: sequence parallelism gathered)")


def self_teacher(host: Any, plan: ScoringPlan, context: str, where: str) -> SelfTeacher:
    """The host's self-teacher (its `student_pass`), or a ValueError naming `where` for a host without one."""
    student_pass = getattr(host, "student_pass", None)
    if student_pass is None:
        raise ValueError(f"{where}: the live self-teacher scores through the host's own pass of the student's model: "
                         "give the host one (LoopHost(vocab_size, ..., student_pass=fn): fn(batch) -> StudentHidden "
                         "of the student's current weights on the batch's response rows: hidden states [R_i, H] and "
                         "the output layer's weight)")
    return SelfTeacher(student_pass, int(host.vocab_size), context=context, plan=plan,
                       tp_group=getattr(host, "tp_group", None),
                       padded_vocab_size=getattr(host, "padded_vocab_size", None))
