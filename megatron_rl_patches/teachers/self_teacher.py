"""The live self-teacher (`SelfTeacher`, entry `student;context=KEY`): the student's current
weights scoring the privileged sequences (`with_context`), through the host's own pass of the
student's model (`LoopHost(student_pass=...)`): no copy of the weights, no server, no weight sync.
The pass runs under `torch.no_grad()` and its logits are detached: no gradient flows through the
teacher's side. Its scores are the student's whole distribution on each row at the step's
temperature: its own top-k, the exact tail (the log-sum-exp of every id outside them) and the
actual token's log-prob, float64.

At tensor parallelism (`tp_group`: the host's) the pass returns each rank's vocabulary shard of
the logits (the model's parallel output, [R_i, V_local], Megatron's padding included): the scores
are computed vocab-parallel by the package's ops (`topk_ids`, `topk_logprobs`: no [R, V] gather),
the same on every rank of the group. Each rank's shape check is agreed over the group before the
ops' first collective (one rank's bad pass is the same error on every rank)."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from megatron_rl_patches._args import positive_int
from megatron_rl_patches.ops.topk import topk_ids, topk_logprobs
from megatron_rl_patches.teachers.agreement import agree_failure, distributed
from megatron_rl_patches.teachers.batch import TeacherBatch
from megatron_rl_patches.teachers.context_key import context_key
from megatron_rl_patches.teachers.contract import BatchScores

# (the teacher's TeacherBatch) -> per sample the student's logits [R_i, V'] on its response rows
# (row r: the logits that predict token response_start + r; V' >= the student's vocabulary: padding cut;
# at tensor parallelism this rank's vocabulary shard [R_i, V_local])
StudentPass = Callable[[TeacherBatch], Sequence[torch.Tensor]]


class SelfTeacher:
    """The student scoring `context + its own response` with its current weights: `student_pass`
    the host's pass (see `StudentPass`), `vocab_size` the student's real vocabulary, `top_k` its
    buckets per row, `temperature` the step's, `context` the key of its privileged contexts
    (required: without one it would be the student scoring itself). `tp_group`: the student's
    tensor-parallel group when the pass returns vocab-parallel logits (None: whole rows), and
    `padded_vocab_size` the rows of its output layer over that group (None: not checked)."""

    def __init__(self, student_pass: StudentPass, vocab_size: int, top_k: int, *, context: str,
                 temperature: float = 1.0, tp_group: Any = None, padded_vocab_size: int | None = None) -> None:
        if not callable(student_pass):
            raise TypeError(f"SelfTeacher(student_pass=...) must be the host's pass of the student's model, a "
                            f"callable (TeacherBatch) -> per-sample logits [R_i, V], got {type(student_pass).__name__}")
        key = context_key(context, "SelfTeacher(context=...)")
        if key is None:
            raise ValueError("SelfTeacher(context=None): the live self-teacher without a privileged context would be "
                             "the student scoring itself (every divergence zero); give it the key of each sample's "
                             "context, e.g. 'student;context=solution'")
        self.student_pass = student_pass
        self.vocab_size = positive_int("SelfTeacher(vocab_size=...)", vocab_size, " (the student's real vocabulary)")
        self.top_k = positive_int("SelfTeacher(top_k=...)", top_k, " (the teacher's buckets per row)")
        if self.top_k > self.vocab_size:
            raise ValueError(f"SelfTeacher(top_k={top_k}) is over the student's vocabulary of {vocab_size}")
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0:
            raise ValueError(f"SelfTeacher(temperature={temperature!r}): pass a positive float")
        self.temperature = float(temperature)
        self.context: str = key
        self.tp_group = tp_group
        self.padded_vocab_size = padded_vocab_size

    def __repr__(self) -> str:
        return f"SelfTeacher(context={self.context!r}, top_k={self.top_k})"

    def score(self, batch: TeacherBatch) -> BatchScores:
        """Every sample's response rows scored by the student's current weights (no grad)."""
        if not isinstance(batch, TeacherBatch):
            raise TypeError(f"SelfTeacher.score(batch) takes a TeacherBatch, got {type(batch).__name__}")
        with torch.no_grad():
            logits = [one.detach() if isinstance(one, torch.Tensor) else one for one in self.student_pass(batch)]
        error: Exception | None = None
        try:
            self.check_pass(logits, batch)
        except ValueError as refused:
            error = refused
        if self.shards() > 1:  # every rank's check before the ops' first collective
            agree_failure(error, self.tp_group, own=True)
        elif error is not None:
            raise error
        rows = [batch.response_rows(i) for i in range(len(batch))]
        if not sum(rows):  # the same batch on every rank of the group: none runs a collective
            empty = [torch.zeros(n, dtype=torch.float64) for n in rows]
            return BatchScores(empty, [torch.zeros(n, self.top_k, dtype=torch.int64) for n in rows],
                               [torch.zeros(n, self.top_k, dtype=torch.float64) for n in rows], list(empty))
        every = torch.cat([one[:, :self.vocab_size] if self.shards() == 1 else one for one in logits]).double()
        tokens = torch.cat([s[start:] for s, start in zip(batch.sequences, batch.response_starts)]).long()
        group, vocab = (self.tp_group, self.vocab_size) if self.shards() > 1 else (None, None)
        with torch.no_grad():
            ids = topk_ids(every, self.top_k, tp_group=group, vocab_size=vocab)
            values, tail = topk_logprobs(every, ids, tp_group=group, temperature=self.temperature, vocab_size=vocab)
            token, _ = topk_logprobs(every, tokens.to(every.device)[:, None], tp_group=group,
                                     temperature=self.temperature, vocab_size=vocab)
        return BatchScores(*(list(part.cpu().split(rows)) for part in (token[:, 0], ids, values, tail)))

    def shards(self) -> int:
        """The tensor-parallel size the pass's logits are split over (1: whole rows)."""
        if self.tp_group is None or not distributed():
            return 1
        import torch.distributed as dist  # lazy: import cost: torch.distributed only with a group

        return dist.get_world_size(self.tp_group)

    def check_pass(self, logits: list[Any], batch: TeacherBatch) -> None:
        """ValueError naming the sample where the pass returned another shape than its response rows of
        logits over the student's vocabulary (this rank's shard of it at tensor parallelism)."""
        if len(logits) != len(batch):
            raise ValueError(f"SelfTeacher: the host's student_pass returned {len(logits)} logit tensors for a batch "
                             f"of {len(batch)} samples: return one [R_i, V] tensor per sample")
        shards, padded = self.shards(), self.padded_vocab_size
        widths = set()
        for sample, one in enumerate(logits):
            count = batch.response_rows(sample)
            if shards == 1:
                good = isinstance(one, torch.Tensor) and one.dim() == 2 and one.shape[0] == count \
                    and one.shape[1] >= self.vocab_size
                wanted = f"[{count}, V >= {self.vocab_size}]"
            else:
                local = padded // shards if padded is not None else None
                good = isinstance(one, torch.Tensor) and one.dim() == 2 and one.shape[0] == count \
                    and one.shape[1] * shards >= self.vocab_size and (local is None or one.shape[1] == local)
                wanted = f"[{count}, {local if local is not None else 'V_local'}] (this rank's shard of the " \
                         f"vocabulary at tensor-parallel size {shards}: the model's parallel output, not gathered)"
            if not good:
                shown = tuple(one.shape) if isinstance(one, torch.Tensor) else type(one).__name__
                raise ValueError(f"SelfTeacher: the host's student_pass returned {shown} for sample {sample}: expected "
                                 f"its {count} response rows of logits over the student's {self.vocab_size} ids "
                                 f"{wanted}")
            widths.add(one.shape[1])
        if len(widths) > 1:
            raise ValueError(f"SelfTeacher: the host's student_pass returned logits of widths {sorted(widths)}: every "
                             "sample's rows come from one output layer (one width)")


def self_teacher(host: Any, top_k: int, temperature: float, context: str, where: str) -> SelfTeacher:
    """The host's self-teacher (its `student_pass`), or a ValueError naming `where` for a host without one."""
    student_pass = getattr(host, "student_pass", None)
    if student_pass is None:
        raise ValueError(f"{where}: the live self-teacher scores through the host's own pass of the student's model: "
                         "give the host one (LoopHost(vocab_size, ..., student_pass=fn): fn(batch) -> per-sample "
                         "logits [R_i, V] of the student's current weights on the batch's response rows)")
    return SelfTeacher(student_pass, int(host.vocab_size), top_k, context=context, temperature=temperature,
                       tp_group=getattr(host, "tp_group", None),
                       padded_vocab_size=getattr(host, "padded_vocab_size", None))
