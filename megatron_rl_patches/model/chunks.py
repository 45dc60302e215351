"""A Megatron model as the package is handed it: one chunk or a list of them (`as_chunks`,
`module_chunks`), the `.module` chain of wrappers around each (Float16Module, DDP: `iter_wrapped`),
the model inside them (`unwrap`, the package's only one), every module of the chunks
(`modules_of`), whether a chunk is the last pipeline stage, and what counts as a DDP chunk.

Imports nothing heavy: wrappers are followed by their `.module` link and a language model is read
from what it holds (`kinds`), so no megatron-core class is imported; torch is looked up in
`sys.modules` (no object can be a torch module where torch was never imported), or imported by
`module_chunks`, whose callers run models.
"""
# lazy imports: import cost: inference.sizing.memory imports this module without torch (tests/test_lazy_import.py)
from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

from megatron_rl_patches.model.kinds import is_language_model

# megatron-core DistributedDataParallel's forward-pre-hook / param-sync API (0.13 to 0.16+)
DDP_HOOK_ATTRS = ("remove_forward_pre_hook_handles", "use_forward_hook", "start_param_sync")


def as_chunks(model_or_list: Any) -> list[Any]:
    """The model chunks as a new list: a list or tuple is copied, anything else is one chunk
    (None included: callers that give None a meaning check it first)."""
    if isinstance(model_or_list, (list, tuple)):
        return list(model_or_list)
    return [model_or_list]


def module_chunks(model_or_list: Any, argument: str) -> list[Any]:
    """as_chunks, requiring a non-empty list of torch.nn.Module; TypeError naming `argument`."""
    import torch

    chunks = as_chunks(model_or_list)
    if not chunks or not all(isinstance(chunk, torch.nn.Module) for chunk in chunks):
        found = type(model_or_list).__name__
        if chunks and isinstance(model_or_list, (list, tuple)):
            found += f" of {[type(chunk).__name__ for chunk in chunks]}"
        raise TypeError(
            f"{argument} must be a torch.nn.Module or a non-empty list of model chunks, got {found}"
        )
    return chunks


def iter_wrapped(module: Any) -> Iterator[Any]:
    """`module`, then the modules it wraps through `.module` (Float16Module, DDP, ...), outermost
    first; stops at a missing or None `.module` and at an object already seen (a cycle)."""
    seen: set[int] = set()
    while module is not None and id(module) not in seen:
        seen.add(id(module))
        yield module
        module = getattr(module, "module", None)


def is_ddp_like(obj: Any) -> bool:
    """True for megatron-core DistributedDataParallel or anything with its hook/sync API
    (DDP_HOOK_ATTRS): what the hook toggles and the train() guard need."""
    return all(hasattr(obj, name) for name in DDP_HOOK_ATTRS)


def has_grad_buffers(obj: Any) -> bool:
    """True for a megatron-core DistributedDataParallel whose grad buffers can be counted
    (`ddp_config` and `buffers`); stricter in purpose than is_ddp_like, which only needs hooks."""
    return hasattr(obj, "ddp_config") and hasattr(obj, "buffers")


def unwrap(module: Any) -> Any:
    """The model inside its wrappers (Float16Module, megatron-core or torch DDP, a framework's own):
    the first link of the `.module` chain that is a language model (GPTModel, HybridModel:
    `kinds.is_language_model`), else the chain's innermost link. Anything without a `.module` is
    returned as is."""
    chain = list(iter_wrapped(module))
    if not chain:
        return module
    return next((link for link in chain if is_language_model(link)), chain[-1])


def is_last_stage(chunk: Any) -> bool:
    """Whether this chunk computes the output layer (GPTModel's `post_process`): only the last
    pipeline stage (per virtual stage with VPP) has log-probs to return."""
    return bool(getattr(unwrap(chunk), "post_process", True))


def modules_of(model: Any, who: str) -> Iterator[Any]:
    """Every module of a model, a list of model chunks or wrappers around them (each chunk's
    `modules()`, the wrappers first); TypeError naming `who` for a chunk that is no torch module."""
    torch = sys.modules.get("torch")  # nothing is a torch module where torch was never imported
    for chunk in as_chunks(model):
        if torch is None or not isinstance(chunk, torch.nn.Module):
            raise TypeError(f"{who}: expected megatron-core model chunks, got {type(chunk).__name__}")
        yield from chunk.modules()
