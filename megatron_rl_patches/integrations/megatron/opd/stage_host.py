"""The host of the teacher step (`teachers.TeacherStep`) for a pipelined Megatron actor (slime's
today; the module was `integrations/slime/host.py`): its groups from megatron-core's
parallel_state (the last pipeline stage's tensor and context-parallel group shares: its first rank
asks the served teachers; the whole job agrees a failure), its samples (a rollout's `tokens` and
`response_lengths` as a `TeacherBatch`), the student's vocabulary and tokenizer (the args'
`hf_checkpoint`: slime's --hf-checkpoint)."""
# lazy imports: optional dependency megatron-core
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from megatron_rl_patches.ops import agreement
from megatron_rl_patches.teachers.batch import TeacherBatch
from megatron_rl_patches.teachers.host import TeacherPass


@dataclass
class StageHost:
    """A `TeacherHost` of a pipelined Megatron actor on this rank; `last` whether it holds the last pipeline
    stage (the only one whose rollout data receives teacher fields) and `asks` whether it asks the
    served teachers (the first rank of the last stage's tensor and context-parallel group)."""

    vocab_size: int
    share_group: Any = None
    job_group: Any = None
    last: bool = True
    asks: bool = True
    teacher_pass: TeacherPass | None = None


def stage_host(vocab_size: int) -> StageHost:
    """This rank's host from megatron-core's parallel_state (no groups without torch.distributed);
    a sharing group of one rank is none."""
    job = agreement.world()  # the job's group (None without torch.distributed: one process)
    if job is None:
        return StageHost(vocab_size)
    from megatron.core import parallel_state as ps  # lazy: optional dependency megatron-core

    last = last_stage()
    group = ps.get_tensor_and_context_parallel_group()
    asks = last and torch.distributed.get_rank(group) == 0
    share = group if torch.distributed.get_world_size(group) > 1 else None
    return StageHost(vocab_size, share, job, last, asks)


def last_stage() -> bool:
    """Whether this rank holds the last pipeline stage (True without pipeline parallelism)."""
    # lazy: import cost: megatron.core takes seconds (4.4 s measured after torch); the settings checks need none
    from megatron.core import parallel_state

    return parallel_state.get_pipeline_model_parallel_world_size() == 1 or \
        parallel_state.is_pipeline_last_stage(ignore_virtual=True)


def pipeline_agrees(flag: bool) -> bool:
    """`flag` held by every stage of this rank's pipeline (an all-reduce MIN over the pipeline
    group), so all stages enter or skip the same pipelined passes."""
    from megatron.core import parallel_state  # lazy: import cost: seconds to import (see `last_stage`)

    return bool(agreement.agreed_min(parallel_state.get_pipeline_model_parallel_group(), int(flag)))


def tp_group() -> Any:
    """The student's tensor-parallel group (None without torch.distributed: one process)."""
    if agreement.world() is None:
        return None
    from megatron.core import parallel_state as ps  # lazy: optional dependency megatron-core

    return ps.get_tensor_model_parallel_group()


def batch_of(rollout_data: dict) -> TeacherBatch:
    """slime's rollout samples (prompt + response ids) as a `TeacherBatch` of their responses."""
    tokens = list(rollout_data["tokens"])
    responses = [int(r) for r in rollout_data["response_lengths"]][: len(tokens)]
    return TeacherBatch([t.detach().cpu() for t in tokens], [len(t) - r for t, r in zip(tokens, responses)])


def device_of(rollout_data: dict) -> torch.device:
    """The device of the rollout's tokens (the CPU for an empty rollout)."""
    return rollout_data["tokens"][0].device if len(rollout_data["tokens"]) else torch.device("cpu")


def student_tokenizer_of(args: Any, where: str) -> Any:
    """The student's tokenizer (slime's --hf-checkpoint), which a served model's is probed against."""
    from megatron_rl_patches.cross_tokenizer.loading import load_tokenizer  # lazy: optional dependency tokenizers

    hf = getattr(args, "hf_checkpoint", None)
    if not isinstance(hf, str):
        raise ValueError(f"{where}: a served teacher's tokenizer is checked against the student's: set slime's "
                         "--hf-checkpoint to the student's Hugging Face directory (its tokenizer.json)")
    return load_tokenizer(hf, "--hf-checkpoint")


def rollout_temperature(args: Any) -> float:
    """slime's --rollout-temperature, which the student's buckets are scored at too (1 when unset)."""
    value = getattr(args, "rollout_temperature", None)
    return 1.0 if value is None else float(value)


# the names from when this module was slime's `host.py` (issue 73), kept for code that typed them
SlimeHost, slime_host = StageHost, stage_host
