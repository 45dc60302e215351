"""build_inference_model: model chunks for a frozen role (teacher, reference, PRM teacher) with
no DDP wrapper, no grad buffer and no optimizer; Megatron-LM's get_model(wrap_with_ddp=False)
is not in the megatron-core wheel, and it would still leave the model trainable."""
# lazy imports: optional dependency megatron-core
from __future__ import annotations

import contextlib
import inspect
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

from megatron_rl_patches._log import logger
from megatron_rl_patches.inference.guard import freeze_chunk
from megatron_rl_patches.inference.loading.paths import resolve_checkpoint
from megatron_rl_patches.inference.loading.weights import load_inference_weights
from megatron_rl_patches.inference.residency.budget import ResidencyBudget
from megatron_rl_patches.inference.residency.host_init import host_initialization
from megatron_rl_patches.inference.residency.placement import attach_checked, check_residency_args
from megatron_rl_patches.model.chunks import has_grad_buffers

# modules defining a DistributedDataParallel (megatron-core's, torch's), looked up in sys.modules
_DDP_MODULES = ("megatron.core.distributed.distributed_data_parallel", "torch.nn.parallel.distributed")


def _accepts_vp_stage(provider: Callable[..., Any]) -> bool:
    try:
        parameters = inspect.signature(provider).parameters.values()
    except (TypeError, ValueError):  # a builtin or C callable: do not guess
        return False
    return any(p.name == "vp_stage" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def _pipeline_stages() -> list[tuple[int | None, bool, bool]]:
    """(vp_stage, pre_process, post_process) for each model chunk this rank holds."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError(
            "build_inference_model needs megatron-core's model-parallel state: call "
            "megatron.core.parallel_state.initialize_model_parallel(...) first (frameworks do it "
            "during their Megatron initialization)"
        )
    vp_size = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    stages: list[int | None] = list(range(vp_size)) if vp_size is not None else [None]
    return [
        (
            vp_stage,
            parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
        )
        for vp_stage in stages
    ]


def _call_provider(provider: Callable[..., Any], vp_stage: int | None, pre: bool, post: bool) -> Any:
    kwargs: dict[str, Any] = {"pre_process": pre, "post_process": post}
    if vp_stage is None:
        model = provider(**kwargs)
    elif _accepts_vp_stage(provider):
        model = provider(**kwargs, vp_stage=vp_stage)
    else:
        with _global_virtual_rank(vp_stage):
            model = provider(**kwargs)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"model_provider must return a torch.nn.Module (a Megatron model chunk), got "
            f"{type(model).__name__} for pre_process={pre}, post_process={post}, vp_stage={vp_stage}"
        )
    _refuse_training_wrappers(model)
    return model


def _refuse_training_wrappers(model: torch.nn.Module) -> None:
    """A DDP-wrapped model (or one whose parameters already carry DDP's `main_grad` views) holds
    the grad buffer this build exists to avoid; unwrapping would not free it (the parameters,
    their hooks and the caller keep references), so it is refused, untouched."""
    ddp_types = tuple(
        cls
        for cls in (getattr(sys.modules.get(name), "DistributedDataParallel", None) for name in _DDP_MODULES)
        if isinstance(cls, type)
    )
    wrapper = next((m for m in model.modules() if isinstance(m, ddp_types) or has_grad_buffers(m)), None)
    if wrapper is not None:
        found = f"a {type(wrapper).__module__}.{type(wrapper).__name__}"
    elif any(hasattr(p, "main_grad") for p in model.parameters()):
        found = "a model whose parameters carry main_grad (views into a DDP grad buffer)"
    else:
        return
    raise TypeError(
        f"model_provider returned {found}; build_inference_model builds frozen chunks with no DDP "
        "wrapper and no grad buffer, so return the bare model (e.g. the GPTModel) from the provider "
        "and do not wrap it in DistributedDataParallel"
    )


@contextlib.contextmanager
def _global_virtual_rank(vp_stage: int) -> Iterator[None]:
    """Providers written before vp_stage existed read the global virtual pipeline rank, which
    megatron-core (0.13+) still honours but deprecates setting: set it, quietly, for the call."""
    from megatron.core import parallel_state

    def set_rank(rank: int | None) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            parallel_state.set_virtual_pipeline_model_parallel_rank(rank)

    previous = parallel_state.get_virtual_pipeline_model_parallel_rank()
    set_rank(vp_stage)
    try:
        yield
    finally:
        set_rank(previous)


def _target_device() -> torch.device | None:
    if not torch.cuda.is_available():
        return None
    current = torch.cuda.current_device()
    # an index normally; accept a device name too (some environments patch current_device)
    return torch.device("cuda", current) if isinstance(current, int) else torch.device(current)


def build_inference_model(
    model_provider: Callable[..., Any],
    *,
    model_type: Any = None,
    config: Any = None,
    load_dir: str | os.PathLike[str] | None = None,
    strict: bool = True,
    residency: str = "resident",
    prefetch: int = 1,
    budget: ResidencyBudget | None = None,
    layout: Any = None,
) -> list[torch.nn.Module]:
    """Model chunks for forward passes only: one per virtual pipeline stage, on the current
    device, Float16Module-wrapped for bf16/fp16, eval mode (kept under later `.train()` calls),
    requires_grad=False, never DDP-wrapped, no grad buffer, no optimizer.

    `model_provider(pre_process, post_process, vp_stage=None)` follows Megatron-LM (`vp_stage`
    passed only when accepted); `config` (default: the model's own `.config`) decides the
    Float16Module wrap; `load_dir` loads weights only (see load_inference_weights).

    `residency`: "resident" (on the device for the whole job), "swap" (host memory; the whole
    model on the device inside `on_device(chunks)` or for each forward) or "stream" (host memory;
    each layer brought in just before it runs, `prefetch` layers ahead, released after); `budget`:
    a ResidencyBudget shared with other swap/stream builds. Swap/stream builds are made and
    loaded in host memory, never on the device whole. See inference/residency/placement.py.

    `layout`: a teacher's own parallel layout is not served here (a Megatron-LM model provider
    builds in parallel_state's groups, the student's): anything but None is refused before the
    provider runs; a Hugging Face checkpoint is built at one by build_inference_model_from_hf.
    """
    if layout is not None:
        raise ValueError(f"build_inference_model(layout={layout!r}): a teacher at its own layout is built from a "
                         "Hugging Face checkpoint only (build_inference_model_from_hf(path, layout=...)): a model "
                         "provider builds in parallel_state's process groups, the student's. Pass layout=None to "
                         "build this model at the student's layout, or convert the checkpoint to Hugging Face")
    mode = check_residency_args(residency, prefetch, budget)
    return build_checked(model_provider, mode, prefetch, budget, model_type=model_type, config=config,
                         load_dir=load_dir, strict=strict)


def build_checked(model_provider: Callable[..., Any], mode: str, prefetch: int, budget: ResidencyBudget | None, *,
                  model_type: Any = None, config: Any = None, load_dir: str | os.PathLike[str] | None = None,
                  strict: bool = True,
                  stages: list[tuple[int | None, bool, bool]] | None = None) -> list[torch.nn.Module]:
    """build_inference_model after check_residency_args passed its residency arguments (a caller that
    checked them, build_inference_model_from_hf, does not check them twice). `stages`: (vp_stage,
    pre_process, post_process) per chunk (default: parallel_state's pipeline stages of this rank;
    a teacher at its own layout without pipeline parallelism: [(None, True, True)])."""
    if not callable(model_provider):
        raise TypeError(
            f"model_provider must be callable as model_provider(pre_process, post_process, "
            f"vp_stage=None), got {type(model_provider).__name__}"
        )
    from megatron.core import tensor_parallel
    from megatron.core.transformer.module import Float16Module

    if load_dir is not None:
        resolve_checkpoint(load_dir)  # a wrong path fails before the model is built
    device = _target_device()
    on_host = mode != "resident"
    chunks: list[torch.nn.Module] = []
    for vp_stage, pre, post in stages if stages is not None else _pipeline_stages():
        with host_initialization(on_host and device is not None):
            model = _call_provider(model_provider, vp_stage, pre, post)
        if model_type is not None:
            model.model_type = model_type
        for param in model.parameters():
            tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)
        if device is not None and not on_host:
            model.to(device)
        chunk_config = config if config is not None else getattr(model, "config", None)
        if chunk_config is not None and (getattr(chunk_config, "fp16", False) or getattr(chunk_config, "bf16", False)):
            model = Float16Module(chunk_config, model)
        chunks.append(freeze_chunk(model))
    logger.debug(
        "megatron-rl-patches: built %d inference-only chunk(s), %d parameters",
        len(chunks),
        sum(p.numel() for chunk in chunks for p in chunk.parameters()),
    )
    if load_dir is not None:
        load_inference_weights(chunks, load_dir, strict=strict)
    if on_host:
        name = getattr(model_provider, "__name__", type(model_provider).__name__)
        attach_checked(chunks, mode, prefetch, budget, device, name)
    return chunks
