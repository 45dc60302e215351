"""The live self-teacher (`SelfTeacher`, entry `student;context=KEY`): the student's current
weights scoring the privileged sequences (`with_context`), through the host's own pass of the
student's model (`LoopHost(student_pass=...)`): no copy of the weights, no server, no weight sync.
The pass runs under `torch.no_grad()` and its logits are detached: no gradient flows through the
teacher's side. Its scores are the student's whole distribution on each row at the step's
temperature: its own top-k, the exact tail (the log-sum-exp of every id outside them) and the
actual token's log-prob, float64."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from megatron_rl_patches._args import positive_int
from megatron_rl_patches.teachers.batch import TeacherBatch
from megatron_rl_patches.teachers.context_key import context_key
from megatron_rl_patches.teachers.contract import BatchScores

# (the teacher's TeacherBatch) -> per sample the student's logits [R_i, V'] on its response rows
# (row r: the logits that predict token response_start + r; V' >= the student's vocabulary: padding cut)
StudentPass = Callable[[TeacherBatch], Sequence[torch.Tensor]]


class SelfTeacher:
    """The student scoring `context + its own response` with its current weights: `student_pass`
    the host's pass (see `StudentPass`), `vocab_size` the student's real vocabulary, `top_k` its
    buckets per row, `temperature` the step's, `context` the key of its privileged contexts
    (required: without one it would be the student scoring itself)."""

    def __init__(self, student_pass: StudentPass, vocab_size: int, top_k: int, *, context: str,
                 temperature: float = 1.0) -> None:
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

    def __repr__(self) -> str:
        return f"SelfTeacher(context={self.context!r}, top_k={self.top_k})"

    def score(self, batch: TeacherBatch) -> BatchScores:
        """Every sample's response rows scored by the student's current weights (no grad)."""
        if not isinstance(batch, TeacherBatch):
            raise TypeError(f"SelfTeacher.score(batch) takes a TeacherBatch, got {type(batch).__name__}")
        with torch.no_grad():
            logits = list(self.student_pass(batch))
        if len(logits) != len(batch):
            raise ValueError(f"SelfTeacher: the host's student_pass returned {len(logits)} logit tensors for a batch "
                             f"of {len(batch)} samples: return one [R_i, V] tensor per sample")
        rows = [self.rows(sample, one.detach(), batch) for sample, one in enumerate(logits)]
        return BatchScores(*(list(part) for part in zip(*rows))) if rows else BatchScores([], [], [], [])

    def rows(self, sample: int, logits: torch.Tensor, batch: TeacherBatch) -> tuple[torch.Tensor, ...]:
        """(token log-probs [R], top-k ids [R, K], their log-probs [R, K], tails [R]) of one sample."""
        count = batch.response_rows(sample)
        if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or logits.shape[0] != count \
                or logits.shape[1] < self.vocab_size:
            shown = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
            raise ValueError(f"SelfTeacher: the host's student_pass returned {shown} for sample {sample}: expected "
                             f"its {count} response rows of logits over at least the student's {self.vocab_size} ids "
                             f"([{count}, V >= {self.vocab_size}])")
        log_probs = torch.log_softmax(logits[:, :self.vocab_size].double() / self.temperature, dim=-1).cpu()
        values, ids = log_probs.topk(self.top_k, dim=-1)
        outside = log_probs.scatter(1, ids, float("-inf"))
        tail = torch.logsumexp(outside, dim=-1)
        token = log_probs.gather(1, batch.sequences[sample][batch.response_starts[sample]:, None].cpu().long())[:, 0]
        return token, ids, values, tail


def self_teacher(host: Any, top_k: int, temperature: float, context: str, where: str) -> SelfTeacher:
    """The host's self-teacher (its `student_pass`), or a ValueError naming `where` for a host without one."""
    student_pass = getattr(host, "student_pass", None)
    if student_pass is None:
        raise ValueError(f"{where}: the live self-teacher scores through the host's own pass of the student's model: "
                         "give the host one (LoopHost(vocab_size, ..., student_pass=fn): fn(batch) -> per-sample "
                         "logits [R_i, V] of the student's current weights on the batch's response rows)")
    return SelfTeacher(student_pass, int(host.vocab_size), top_k, context=context, temperature=temperature)
