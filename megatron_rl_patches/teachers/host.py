"""What a training framework supplies to the teacher step (`TeacherStep`): its groups, its
student's vocabulary and, optionally, how an in-process teacher's pass runs.

- `share_group`: the ranks that hold the same samples (the tensor / context-parallel group). Its
  first rank asks the served teachers; the others receive the scores by broadcast.
- `job_group`: the ranks whose failures are agreed (the whole job: no healthy rank waits in the
  gradient all-reduce while another raises).
- `vocab_size`: the student's real vocabulary (before Megatron's padding).
- `teacher_pass`: runs an in-process teacher on a batch (e.g. under the framework's no-grad /
  offload context); None calls `teacher.score(batch)` as it is.
- `build_teacher` (optional): (entry, options) -> the teacher of an in-process kind (a checkpoint,
  a provider), for `build_teachers`; a host without one builds served teachers only.
- `student_pass` (optional): the host's own pass of the student's current model over a
  `TeacherBatch` -> `StudentHidden`: per sample its final hidden states [R_i, H] on the response
  rows and its output layer's weight (never logits): the live self-teacher's (`student;context=KEY`,
  `teachers.SelfTeacher`: the fused head's top-k), run under no grad, no copy of the weights.
- `tp_group`, `padded_vocab_size` (optional): the student's tensor-parallel group and its padded
  vocabulary (the rows of its output layer over that group): a teacher head built from a `;head=DIR`
  entry is cut and padded to the student's layout (None: the whole head, unpadded).

`TeacherHost` is the protocol; `LoopHost` a plain one; `megatron_host` builds one from
megatron-core's parallel_state for a hand-written Megatron loop (the module passed in: this
package never imports megatron-core) and `local_host` one with no groups (one process)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from megatron_rl_patches.ops.scoring_plan import positive_int

TeacherPass = Callable[[Any, Any], Any]  # (teacher, TeacherBatch) -> BatchScores


class TeacherHost(Protocol):
    """The groups, vocabulary and pass function a framework hands the teacher step."""

    share_group: Any
    job_group: Any
    vocab_size: int
    teacher_pass: TeacherPass | None


@dataclass(frozen=True)
class LoopHost:
    """A `TeacherHost` from its parts (None for a group: nobody to share with / agree with)."""

    vocab_size: int
    share_group: Any = None
    job_group: Any = None
    teacher_pass: TeacherPass | None = None
    build_teacher: Callable[[Any, Any], Any] | None = None
    student_pass: Callable[[Any], Any] | None = None
    tp_group: Any = None
    padded_vocab_size: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.vocab_size, bool) or not isinstance(self.vocab_size, int) or self.vocab_size < 1:
            raise ValueError(f"LoopHost(vocab_size={self.vocab_size!r}): pass the student's real vocabulary size, a "
                             f"positive int (before Megatron's padding)")
        if self.teacher_pass is not None and not callable(self.teacher_pass):
            raise TypeError(f"LoopHost(teacher_pass=...) must be a callable (teacher, batch) -> BatchScores or None, "
                            f"got {type(self.teacher_pass).__name__}")
        if self.student_pass is not None and not callable(self.student_pass):
            raise TypeError(f"LoopHost(student_pass=...) must be a callable (TeacherBatch) -> StudentHidden "
                            f"(hidden states and output weight) or None, got {type(self.student_pass).__name__}")
        if self.build_teacher is not None and not callable(self.build_teacher):
            raise TypeError(f"LoopHost(build_teacher=...) must be a callable (entry, options) -> teacher or None, "
                            f"got {type(self.build_teacher).__name__}")
        padded = self.padded_vocab_size
        if padded is not None and (isinstance(padded, bool) or not isinstance(padded, int)
                                   or padded < self.vocab_size):
            raise ValueError(f"LoopHost(padded_vocab_size={padded!r}): pass the rows of the student's output layer "
                             f"over its tensor-parallel group, an int >= vocab_size ({self.vocab_size}), or None")


def megatron_host(parallel_state: Any, vocab_size: int, teacher_pass: TeacherPass | None = None, *,
                  context_parallel: bool = True, make_vocab_size_divisible_by: int = 128,
                  student_pass: Callable[[Any], Any] | None = None) -> LoopHost:
    """The host of a hand-written Megatron loop from megatron-core's `parallel_state` module (pass
    it: `from megatron.core import parallel_state`; initialized first): the tensor (and context,
    unless `context_parallel=False`) -parallel group shares, the whole world agrees. The student's
    vocabulary is padded as Megatron-LM pads it (`make_vocab_size_divisible_by` x TP, its
    `--make-vocab-size-divisible-by`, default 128) and sharded over the tensor-parallel group: a
    `;head=DIR` teacher built for this host holds the same rows on each rank. `student_pass`: the
    live self-teacher's pass (see `LoopHost`): whole hidden rows [R_i, H] per sample and this rank's
    shard of the output weight [padded / TP, H], as the model's output layer holds it."""
    import torch.distributed as dist  # lazy: import cost: torch only when a host with groups is built

    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError("megatron_host: megatron-core's parallel_state is not initialized: call "
                           "initialize_model_parallel(...) first, or use local_host() without a distributed job")
    divisor = positive_int("megatron_host(make_vocab_size_divisible_by=...)", make_vocab_size_divisible_by)
    share = (parallel_state.get_tensor_and_context_parallel_group() if context_parallel
             else parallel_state.get_tensor_model_parallel_group())
    tp_group = parallel_state.get_tensor_model_parallel_group()
    multiple = divisor * dist.get_world_size(tp_group)
    padded = -(-vocab_size // multiple) * multiple if isinstance(vocab_size, int) and vocab_size > 0 else None
    return LoopHost(vocab_size, share, dist.group.WORLD, teacher_pass, student_pass=student_pass, tp_group=tp_group,
                    padded_vocab_size=padded)


def asks(host: TeacherHost) -> bool:
    """Whether this rank asks the served teachers: the first rank of the host's sharing group."""
    group = host.share_group
    if group is None:
        return True
    import torch.distributed as dist  # lazy: import cost: torch only with a group

    if not (dist.is_available() and dist.is_initialized()):
        return True
    return dist.get_rank(group) == 0


def local_host(vocab_size: int, teacher_pass: TeacherPass | None = None) -> LoopHost:
    """The host of one process without torch.distributed: nothing shared, nothing agreed."""
    return LoopHost(vocab_size, None, None, teacher_pass)
