"""Weights-only loading for inference-only chunks: the model's sharded state dict from a
megatron-core torch_dist checkpoint (torch_dist.py: no optimizer, scheduler, RNG or common state),
or a plain torch state-dict file. Everything is checked before anything is copied."""
# lazy imports: import cost: torch.distributed.checkpoint (sympy) only for a dist checkpoint
from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from megatron_rl_patches._log import logger
from megatron_rl_patches.inference.loading.errors import (  # noqa: F401 - WeightsMismatchError re-exported
    SHOW,
    CheckpointReadError,
    WeightsMismatchError,
    check_fit,
    copying_into_model,
    describe,
    shown,
)
from megatron_rl_patches.inference.loading.paths import resolve_checkpoint
from megatron_rl_patches.inference.residency.placement import weights_on_host
from megatron_rl_patches.model.chunks import module_chunks, unwrap


def _model_keys(count: int) -> list[str]:
    """Where Megatron-LM checkpoints nest each chunk's state: "model", or "model{i}" per chunk."""
    return ["model"] if count == 1 else [f"model{i}" for i in range(count)]


# ---------------------------------------------------------------------------- torch file


def _read_state_dicts(path: Path, count: int) -> list[Mapping[Any, Any]]:
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # truncated (OSError, RuntimeError), not a torch file, not weights-only
        raise CheckpointReadError(
            path,
            f"not a readable weights-only torch state-dict file (torch.load(weights_only=True) failed: "
            f"{describe(exc)}); save model.state_dict() with torch.save, and check the copy is complete",
        ) from exc
    if not isinstance(obj, Mapping):
        raise ValueError(
            f"{str(path)!r} holds a {type(obj).__name__}, expected a state dict (a mapping of names to tensors)"
        )
    names = _model_keys(count)
    if all(isinstance(obj.get(name), Mapping) for name in names):
        return [obj[name] for name in names]
    if count == 1:
        return [obj]
    raise ValueError(
        f"{str(path)!r}: {count} model chunks need one state dict each under the keys "
        f"{', '.join(names)}; found keys {', '.join(map(str, list(obj)[:SHOW]))}"
    )


def _strip_prefix(state: Mapping[Any, Any], expected: Mapping[str, Any]) -> Mapping[Any, Any]:
    """Accept a state dict saved from the Float16Module/DDP wrapper ('module.' prefixed keys)."""
    prefix = "module."
    if (
        state
        and all(isinstance(k, str) and k.startswith(prefix) for k in state)
        and not any(k.startswith(prefix) for k in expected)
    ):
        return {k[len(prefix):]: v for k, v in state.items()}
    return state


def _unusable_value(value: Any, expected: Any) -> str | None:
    """Why `value` cannot be copied into the model's tensor `expected` (None: it can)."""
    if not isinstance(expected, torch.Tensor):
        return None  # _extra_state and other non-tensor state: the module decides
    if not isinstance(value, torch.Tensor):
        return type(value).__name__
    if value.is_meta:
        return "a meta tensor (no data)"
    if value.layout != torch.strided:  # copy_ from sparse fails half-way, after earlier entries were written
        return f"a {value.layout} tensor: save dense weights (.to_dense())"
    if value.shape != expected.shape:
        return None  # reported as a shape mismatch
    if value.is_complex() != expected.is_complex():  # copy_ would drop the imaginary part silently
        return f"a {value.dtype} tensor"
    return None


def _load_file(modules: list[torch.nn.Module], path: Path, strict: bool) -> None:
    states = _read_state_dicts(path, len(modules))
    plans = []
    missing: list[str] = []
    unexpected: list[str] = []
    shapes: list[str] = []
    unusable: list[str] = []
    for index, (module, state) in enumerate(zip(modules, states)):
        expected = module.state_dict()
        state = _strip_prefix(state, expected)
        tag = f"model{index}." if len(modules) > 1 else ""
        # _extra_state entries are metadata (e.g. fp8 scaling), not weights: never required
        missing += [tag + k for k in expected if k not in state and not k.endswith("_extra_state")]
        unexpected += [f"{tag}{k}" for k in state if k not in expected]
        shapes += [
            f"{tag}{k} (checkpoint {tuple(v.shape)}, model {tuple(expected[k].shape)})"
            for k, v in state.items()
            if k in expected and isinstance(v, torch.Tensor) and isinstance(expected[k], torch.Tensor)
            and v.shape != expected[k].shape
        ]
        # every entry is checked before any chunk is written (a bad value in chunk 1 spares chunk 0)
        unusable += [
            f"{tag}{k} ({why})"
            for k, v in state.items()
            if k in expected and (why := _unusable_value(v, expected[k])) is not None
        ]
        plans.append((module, {k: v for k, v in state.items() if k in expected}))
    if unusable:
        raise CheckpointReadError(path, f"{len(unusable)} value(s) are not weights: {shown(unusable)}")
    check_fit(path, missing, unexpected, shapes, strict)
    with copying_into_model(path):
        for module, state in plans:
            module.load_state_dict(state, strict=False)


# ---------------------------------------------------------------------------- public


def load_inference_weights(
    model: Any,
    load_dir: str | os.PathLike[str],
    strict: bool = True,
    *,
    iteration: int | None = None,
) -> int:
    """Load the model weights only (no optimizer, scheduler, RNG or common state) into `model`
    (a chunk or the list build_inference_model returned); returns the checkpoint's iteration
    (0 for a file, a 'release' checkpoint or a bare dist directory).

    `load_dir`: a Megatron-LM checkpoint root (the iteration latest_checkpointed_iteration.txt
    names, or `iteration`), an iter_XXXXXXX directory, a torch_dist directory, or a torch
    state-dict file. Raises, before copying anything: WeightsMismatchError (a ValueError listing
    the first offending keys) when the checkpoint does not fit, CheckpointReadError (a ValueError
    naming the path) when its content is unreadable (truncated, corrupt, not tensors).
    """
    chunks = module_chunks(model, "model")
    modules = [unwrap(chunk) for chunk in chunks]
    kind, path, found = resolve_checkpoint(load_dir, iteration)

    with torch.no_grad(), weights_on_host(chunks):  # swap/stream builds: into their host copies
        if kind == "dist":
            from megatron_rl_patches.inference.loading.torch_dist import load_dist

            load_dist(modules, _model_keys(len(modules)), path, bool(strict))
        else:
            _load_file(modules, path, bool(strict))
    logger.info("megatron-rl-patches: loaded weights only from %s (iteration %d)", path, found)
    return found


