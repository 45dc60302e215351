"""A GPTModel's pass for the live self-teacher (`teachers.SelfTeacher`) in tests, examples and
benchmarks: per sample its final hidden states on the response rows and the output weight
(`StudentHidden`), from megatron-core's `output_processor=` hook (megatron-core >= 0.18, or the
package's `gpt_output_processor` patch applied: `megatron_rl_patches.apply(only="gpt_output_processor")`),
so no [R, V] logits exist."""
from __future__ import annotations

from typing import Any

import torch

from megatron_rl_patches.processors.distill import hidden_output_processor
from megatron_rl_patches.teachers.batch import TeacherBatch
from megatron_rl_patches.teachers.self_teacher import StudentHidden


def response_hidden(model: Any, batch: TeacherBatch) -> StudentHidden:
    """Each sequence of `batch` alone through `model` (causal), its response rows' hidden states
    [R_i, H] (row r predicts token response_start + r) and `model.output_layer.weight`."""
    rows = []
    for sequence, start in zip(batch.sequences, batch.response_starts):
        hidden = model(sequence[None], torch.arange(len(sequence))[None], None,
                       output_processor=hidden_output_processor())
        rows.append(hidden[0, start - 1:-1])
    return StudentHidden(rows, model.output_layer.weight)
