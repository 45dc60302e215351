"""The train step's served teachers in slime's train-side metrics (`teacher/...`): after the
teachers scored a step (`served_opd.note_figures`, on the last pipeline stage: each served teacher's
`TeacherStep.metrics()`, summed, under `topk_request.FIGURES` in the rollout data), slime's own
`log_rollout_data` logs them through its `gather_log_data("teacher", ...)` — averaged over the
data-parallel ranks, to wandb / TensorBoard and its log line — on the ranks that log slime's own
(tensor-parallel rank 0 of the last stage: the same collective). Fixed keys
(`step_metrics.fixed_figures`), so every rank's dict reduces alike: the step's `samples`, `rows`,
`scored_before` (carried from the rollout), `collect_s`, `collect_wait_s`, the teachers' `bytes`,
`retries`, `failovers`, `hedges_sent`, `hedges_won`, `taken_out` (a count) and the slowest
replica's `latency_p50_s` / `latency_p95_s` (0 without an answer)."""
from __future__ import annotations

from typing import Any


def log_figures(rollout_id: Any, args: Any, figures: dict[str, float] | None) -> None:
    """`figures` through slime's `gather_log_data` as `teacher/...`, on the ranks slime logs its
    rollout metrics from (tensor-parallel rank 0 of the last pipeline stage)."""
    if figures is None:
        return
    from megatron.core import mpu  # lazy: optional dependency megatron-core
    from slime.observability.train_metric_utils import gather_log_data  # lazy: optional dependency slime

    if mpu.get_tensor_model_parallel_rank() == 0 and mpu.is_pipeline_last_stage():
        gather_log_data("teacher", args, rollout_id, dict(figures))
