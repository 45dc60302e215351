"""Keep frozen (inference-only) model chunks frozen: a marker, an eval lock, and clear errors
where DDP-assuming code (grad sync, grad buffers, optimizer steps) meets a frozen chunk."""
from __future__ import annotations

import functools
from typing import Any

from megatron_rl_patches._log import logger
from megatron_rl_patches.model.chunks import as_chunks, iter_wrapped

MARKER = "_mrp_inference_only"

# DistributedDataParallel methods that only make sense for a trainable chunk: on a frozen chunk
# they raise InferenceOnlyError instead of an AttributeError deep inside the framework.
TRAINING_ONLY_METHODS = (
    "zero_grad_buffer",
    "no_sync",
    "start_grad_sync",
    "finish_grad_sync",
    "start_param_sync",
    "scale_gradients",
    "broadcast_params",
)
# Forward-pre-hook toggles: a frozen chunk has no param-gather hooks, so "enabled" and
# "disabled" are both already true; these are no-ops (frameworks toggle them around saves).
HOOK_TOGGLES = ("enable_forward_pre_hook", "disable_forward_pre_hook")

_train_call_logged = False


class InferenceOnlyError(TypeError):
    """A model chunk built inference-only reached code that trains (grad sync, optimizer step)."""


def is_inference_only(chunk: Any) -> bool:
    """True when `chunk` (or a module it wraps) was built by build_inference_model."""
    return any(getattr(module, MARKER, False) is True for module in iter_wrapped(chunk))


def assert_trainable(model_chunks: Any, action: str = "train") -> None:
    """Raise InferenceOnlyError when any chunk was built inference-only; call it before
    building an optimizer or running a training step on `model_chunks` (a module or a list)."""
    for index, chunk in enumerate(as_chunks(model_chunks)):
        if is_inference_only(chunk):
            raise InferenceOnlyError(
                f"cannot {action} model chunk {index} ({type(chunk).__name__}): it was built "
                "inference-only (no DDP grad buffer, no optimizer, requires_grad=False). Pass the "
                "trainable model's chunks, or build this role trainable by removing it from "
                "MEGATRON_RL_PATCHES_INFERENCE_ROLES"
            )


def _locked_train(module: Any, mode: bool = True) -> Any:
    """Replacement for `module.train`: always eval, so dropout stays off in a frozen model."""
    global _train_call_logged  # not an argument: nn.Module.train(self, mode=True) is torch's signature
    if not isinstance(mode, bool):
        raise ValueError(f"training mode is expected to be boolean, got {type(mode).__name__}")
    if mode and not _train_call_logged:
        _train_call_logged = True
        logger.debug(
            "megatron-rl-patches: .train() called on an inference-only %s; it stays in eval mode",
            type(module).__name__,
        )
    return type(module).train(module, False)


def _refuse(name: str, chunk_type: str, *args: Any, **kwargs: Any) -> Any:
    raise InferenceOnlyError(
        f"{chunk_type}.{name}() called on a model chunk built inference-only: it has no DDP grad "
        "buffer and must not reach grad sync or an optimizer step. Train only the trainable "
        "model; frozen roles are listed in MEGATRON_RL_PATCHES_INFERENCE_ROLES"
    )


def _noop_toggle(name: str, *args: Any, **kwargs: Any) -> None:
    logger.debug("megatron-rl-patches: %s() on an inference-only chunk: nothing to toggle", name)


def freeze_chunk(chunk: Any) -> Any:
    """Mark `chunk` inference-only, set requires_grad=False and eval mode, lock eval mode on
    every submodule, and give the chunk DDP-named methods that refuse training. Returns it."""
    chunk.requires_grad_(False)
    chunk.eval()
    for module in iter_wrapped(chunk):
        object.__setattr__(module, MARKER, True)
    # functools.partial (not a closure or bound method) keeps the chunk picklable and deep-copyable
    for module in chunk.modules():
        object.__setattr__(module, "train", functools.partial(_locked_train, module))
    for name in TRAINING_ONLY_METHODS:
        object.__setattr__(chunk, name, functools.partial(_refuse, name, type(chunk).__name__))
    for name in HOOK_TOGGLES:
        object.__setattr__(chunk, name, functools.partial(_noop_toggle, name))
    return chunk
