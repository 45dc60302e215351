"""Pipeline (PP) and interleaved virtual-pipeline (VPP) worlds on CPU: the model chunks of this
rank's stage(s), built by any Megatron-LM style provider, to run with megatron-core's real
`get_forward_backward_func()` schedule (`megatron_cpu.run_schedule`) over gloo p2p."""
# lazy imports: optional dependency megatron-core
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from megatron_rl_patches.testing.megatron_cpu import tiny_gpt_config


def tiny_pipeline_config(pipeline: int = 2, virtual: int | None = None, **overrides: Any) -> Any:
    """`tiny_gpt_config` split over `pipeline` stages (× `virtual` chunks each): one layer per
    chunk unless `num_layers` says otherwise; unbatched p2p (`batch_p2p_comm=False`, as Megatron-LM
    runs virtual stages: batched, gloo swaps the interleaved schedule's two tensors to one peer,
    see `megatron_cpu.check_interleaved_p2p`)."""
    values: dict[str, Any] = dict(num_layers=pipeline * (virtual or 1), pipeline_model_parallel_size=pipeline,
                                  batch_p2p_comm=False)
    if virtual is not None:
        values["virtual_pipeline_model_parallel_size"] = virtual
    values.update(overrides)
    return tiny_gpt_config(**values)


def stage_flags(vp_stage: int | None = None) -> tuple[bool, bool]:
    """(pre_process, post_process) of this rank's stage (of its `vp_stage`-th chunk under VPP)."""
    from megatron.core import parallel_state

    if vp_stage is None:
        return parallel_state.is_pipeline_first_stage(), parallel_state.is_pipeline_last_stage()
    return (parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage))


def pipeline_chunks(provider: Callable[..., Any]) -> list[Any]:
    """This rank's model chunks: one per virtual stage (one without VPP), each from
    `provider(pre_process=, post_process=, vp_stage=)` (e.g. `tiny_provider("gpt", config)`)."""
    from megatron.core import parallel_state

    virtual = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    chunks = []
    for vp_stage in range(virtual) if virtual else [None]:
        pre, post = stage_flags(vp_stage)
        chunks.append(provider(pre_process=pre, post_process=post, vp_stage=vp_stage))
    return chunks


def is_last_stage() -> bool:
    """This rank holds the pipeline's last stage (the one whose forward steps see the losses)."""
    from megatron.core import parallel_state

    return parallel_state.is_pipeline_last_stage(ignore_virtual=True)
