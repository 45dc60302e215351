"""The served teacher in verl's per-step metrics (`teacher/...`, issue 88 item 4), through the seam
verl's own agent-loop figures take: each agent-loop worker's `generate_sequences` returns one
metrics dict per sample in its output's `meta_info["metrics"]`; verl's `AgentLoopManager` gathers
the workers' lists and turns them into its `timing` dict (`_performance_metrics`), which the
trainer adds to its `timing_raw` and logs as `timing_s/<key>` (verl 0.9.1:
`experimental/agent_loop/agent_loop.py` generate_sequences and `_performance_metrics`,
`trainer/ppo/ray_trainer.py` `timing_raw.update(...meta_info["timing"])`,
`trainer/ppo/metric_utils.py` compute_timing_metrics). verl's trainer is not patched.

- In each agent-loop worker (`generate_sequences_wrapper`): after verl's own call, the worker's
  served teachers (held by its teacher client, `served.served_teacher`) are read once
  (`ServedTeacher.metrics()`: what they did since the last read, i.e. this call's samples) and
  summed; the sum rides on the output's first per-sample dict under `KEY`, the other samples'
  `KEY` is None (every sample's dict gets the key: verl's concat wants the same keys in all).
- In verl's manager (`performance_metrics_wrapper`): the workers' sums summed once more and added
  to verl's timing dict as `teacher/...` (`step_metrics.flat`): `samples`, `rows`, `bytes`,
  `retries`, `failovers`, `hedges_sent`, `hedges_won` (sums over the workers), `taken_out` (a
  count), and per replica `replica/HOST:PORT/requests`, `.../failed` (sums) and
  `.../latency_p50_s`, `.../latency_p95_s` (the slowest worker's: an upper bound of the
  replica's percentile over all workers). verl logs them as `timing_s/teacher/...`.

Only with MEGATRON_RL_PATCHES_VERL_TEACHER set (a served route); a call with no served teacher
read (verl's own replicas, the live self-teacher, a validation pass before any step) adds no key."""
from __future__ import annotations

from typing import Any

from megatron_rl_patches.integrations.verl.entry import verl_teacher
from megatron_rl_patches.integrations.verl.held import peek
from megatron_rl_patches.model.arguments import bind
from megatron_rl_patches.teachers.step.metrics import flat, served_summed

KEY = "megatron_rl_patches_teacher"


def worker_figures(worker: Any) -> dict[str, Any] | None:
    """The figures of the served teachers `worker`'s teacher client holds since their last read
    (summed), None where it holds none."""
    teachers = peek(getattr(worker, "teacher_server_manager", None), "served_teachers")
    if not teachers:
        return None
    return served_summed([teacher.metrics() for teacher in teachers.values()])


def generate_sequences_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper on verl's `AgentLoopWorker.generate_sequences`: its output's per-sample
    metrics carry the worker's served-teacher figures (`KEY`)."""
    if verl_teacher(instance).entry is None:
        return wrapped(*args, **kwargs)
    return with_figures(wrapped(*args, **kwargs), instance)


async def with_figures(call: Any, worker: Any) -> Any:
    """`call`'s output, its per-sample metrics dicts given `KEY` (the figures on the first)."""
    output = await call
    samples = output.meta_info.get("metrics")
    if isinstance(samples, list) and samples:
        figures = worker_figures(worker)
        for index, sample in enumerate(samples):
            sample[KEY] = figures if index == 0 else None
    return output


def performance_metrics_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper on verl's `AgentLoopManager._performance_metrics(metrics, output)`: verl's
    timing dict plus the workers' served-teacher figures as `teacher/...`."""
    timing = wrapped(*args, **kwargs)
    bound = bind(wrapped, args, kwargs)
    if bound is None or not isinstance(timing, dict):
        return timing
    # a fork's method without verl's `metrics` parameter: its timing as it is (a KeyError after verl's call before)
    each = [sample[KEY] for chunk in bound.arguments.get("metrics") or [] for sample in chunk
            if isinstance(sample, dict) and sample.get(KEY)]
    if each:
        timing.update(flat(served_summed(each)))
    return timing
