"""slime's rollout fields for the own passes of a teacher with another tokenizer: its samples
(`cross_tokenizer.TeacherSample`) and their micro-batches (`cross_tokenizer.teacher_passes.PassBatches`)
in the keys slime's forward_only reads."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from megatron_rl_patches.cross_tokenizer.teacher_passes import PassBatches, TeacherSample


def teacher_rollout(samples: Sequence[TeacherSample], plan: PassBatches) -> dict[str, Any]:
    """The teacher's ids, lengths, loss masks (every response token) and micro-batches, its
    repeated samples included (`plan.padded`)."""
    every = plan.padded(samples)
    return {"tokens": [s.tokens for s in every], "total_lengths": [int(s.tokens.numel()) for s in every],
            "response_lengths": [s.response_length for s in every],
            "loss_masks": [torch.ones(s.response_length, dtype=torch.int, device=s.tokens.device) for s in every],
            "micro_batch_indices": plan.micro_batches, "num_microbatches": [len(plan.micro_batches)]}
