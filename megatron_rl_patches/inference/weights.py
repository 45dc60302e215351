"""Weights-only loading for inference-only chunks: the model's sharded state dict from a
megatron-core dist checkpoint (no optimizer, scheduler, RNG or common state), or a plain torch
state-dict file. Everything is checked before anything is copied, so a failed load changes
nothing."""
from __future__ import annotations

import logging
import os
import pickle
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from megatron_rl_patches._chunks import module_chunks, unwrap
from megatron_rl_patches.inference.paths import resolve_checkpoint

logger = logging.getLogger("megatron_rl_patches")

# checkpoint keys that are not model weights: a training checkpoint holds them beside the model
_NON_MODEL_PREFIXES = ("optimizer.", "rng_state", "rerun_state_machine_state")
_SHOW = 5


class WeightsMismatchError(ValueError):
    """The checkpoint does not fit the model: missing or unexpected keys, or shape mismatches."""

    def __init__(self, source: str, missing: Sequence[str], unexpected: Sequence[str], shapes: Sequence[str]):
        self.missing, self.unexpected, self.shape_mismatches = list(missing), list(unexpected), list(shapes)
        parts = []
        for label, items in (("missing", missing), ("unexpected", unexpected), ("shape mismatches", shapes)):
            if items:
                shown = ", ".join(items[:_SHOW]) + (f", ... ({len(items) - _SHOW} more)" if len(items) > _SHOW else "")
                parts.append(f"{len(items)} {label}: {shown}")
        super().__init__(
            f"checkpoint {source} does not match the model ({'; '.join(parts)}). Check that the model "
            "provider builds the architecture the checkpoint was saved from (layers, hidden size, "
            "vocab padding, tied embeddings); strict=False tolerates missing/unexpected keys, "
            "never shape mismatches"
        )


def _check_fit(path: Path, missing: Sequence[str], unexpected: Sequence[str], shapes: Sequence[str], strict: bool) -> None:
    """Raise WeightsMismatchError on any shape mismatch, or on missing/unexpected keys when
    `strict`; else warn once about the tolerated keys. Runs before anything is copied."""
    if shapes or (strict and (missing or unexpected)):
        raise WeightsMismatchError(repr(str(path)), missing, unexpected, shapes)
    if not (missing or unexpected):
        return
    from megatron_rl_patches._log import warn_once  # rank 0 only, once per message

    warn_once(
        f"non-strict load from {path}: {len(missing)} missing key(s) keep their values "
        f"({', '.join(missing[:_SHOW]) or '-'}), {len(unexpected)} unexpected key(s) ignored "
        f"({', '.join(unexpected[:_SHOW]) or '-'})"
    )


def _model_keys(count: int) -> list[str]:
    """Where Megatron-LM checkpoints nest each chunk's state: "model", or "model{i}" per chunk."""
    return ["model"] if count == 1 else [f"model{i}" for i in range(count)]


def _format_shape(key: str, found: Any, expected: Any) -> str:
    return f"{key} (checkpoint {tuple(found)}, model {tuple(expected)})"


# ---------------------------------------------------------------------------- torch_dist


class _ShardedKeys:
    """The ShardedTensor / ShardedObject keys a (nested) sharded state dict holds, after
    applying sharded-tensor factories (which save under keys of their own)."""

    def __init__(self, value: Any):
        self.tensors: dict[str, tuple[tuple[int, ...], bool]] = {}
        self.objects: set[str] = set()
        self._walk(value)

    def _walk(self, value: Any) -> None:
        from megatron.core.dist_checkpointing.dict_utils import nested_values
        from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory

        # nested_values: the same dict / list nesting dist_checkpointing.load itself walks
        for item in nested_values(value) if isinstance(value, (dict, list)) else (value,):
            if isinstance(item, ShardedTensorFactory):
                self._walk(item.build())
            elif isinstance(item, ShardedTensor):
                self.tensors[item.key] = (tuple(item.global_shape), bool(item.allow_shape_mismatch))
            elif isinstance(item, ShardedObject):
                self.objects.add(item.key)

    def all(self) -> set[str]:
        return set(self.tensors) | self.objects


def _weights_only_common_strategy() -> Any:
    """A common-state load strategy that reads nothing from common.pt: that file holds pickled
    training state (args, scheduler), which megatron-core 0.16 with torch >= 2.6 cannot even
    unpickle (weights_only) and which a frozen model does not need."""
    from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy

    class WeightsOnlyCommonLoadStrategy(TorchCommonLoadStrategy):
        def load_common(self, checkpoint_dir: Any) -> dict:
            return {}

    return WeightsOnlyCommonLoadStrategy()


def _checkpoint_keys(path: Path) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

    tensors = {key: tuple(t.global_shape) for key, t in dist_checkpointing.load_tensors_metadata(str(path)).items()}
    objects = {
        v.key
        for v in load_sharded_metadata(str(path), common_strategy=_weights_only_common_strategy()).values()
        if isinstance(v, ShardedObject)
    }
    return tensors, objects


def _drop_keys(value: Any, drop: set[str]) -> Any:
    """Remove (in place) the entries of a nested sharded state dict whose keys are all in `drop`."""
    if drop and isinstance(value, dict):
        for name in list(value):
            item = value[name]
            keys = _ShardedKeys(item).all()
            if keys and keys <= drop:
                del value[name]
            elif isinstance(item, (dict, list)):
                _drop_keys(item, drop)
    return value


def _shapes_fit(found: tuple[int, ...], expected: tuple[int, ...], vocab_padded: bool) -> bool:
    """allow_shape_mismatch marks vocab-padded tensors: only their vocab (first) dim may differ."""
    if vocab_padded:
        return len(found) == len(expected) and found[1:] == expected[1:]
    return found == expected


def _pipeline_parallel() -> bool:
    from megatron.core import parallel_state

    return (
        parallel_state.model_parallel_is_initialized()
        and parallel_state.get_pipeline_model_parallel_world_size() > 1
    )


def _load_dist(modules: list[torch.nn.Module], path: Path, strict: bool) -> None:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "loading a torch_dist checkpoint needs torch.distributed initialized (the same process "
            "groups the model was built under); initialize it first"
        )
    names = _model_keys(len(modules))  # ShardedTensor keys are global, whatever the nesting
    # Built once: the key walk only reads it, the load request is this same dict minus missing keys.
    sharded = {name: module.sharded_state_dict() for name, module in zip(names, modules)}
    wanted = _ShardedKeys(sharded)
    ckpt_tensors, ckpt_objects = _checkpoint_keys(path)
    missing = sorted(k for k in wanted.tensors if k not in ckpt_tensors) + sorted(
        k for k in wanted.objects if k not in ckpt_objects
    )
    shapes = sorted(
        _format_shape(k, ckpt_tensors[k], shape)
        for k, (shape, vocab_padded) in wanted.tensors.items()
        if k in ckpt_tensors and not _shapes_fit(ckpt_tensors[k], shape, vocab_padded)
    )
    # With pipeline parallelism each rank holds only its stages' keys: the rest are not "unexpected".
    unexpected = (
        []
        if _pipeline_parallel()
        else sorted(
            k for k in ckpt_tensors if k not in wanted.tensors and not k.startswith(_NON_MODEL_PREFIXES)
        )
    )
    _check_fit(path, missing, unexpected, shapes, strict)
    request = {name: _drop_keys(state, set(missing)) for name, state in sharded.items()}
    loaded = dist_checkpointing.load(
        request,
        str(path),
        common_strategy=_weights_only_common_strategy(),
        strict=StrictHandling.ASSUME_OK_UNEXPECTED,
    )
    for name, module in zip(names, modules):
        module.load_state_dict(loaded[name], strict=strict and not missing)


# ---------------------------------------------------------------------------- torch file


def _read_state_dicts(path: Path, count: int) -> list[Mapping[str, Any]]:
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as exc:
        raise ValueError(
            f"{str(path)!r} is not a weights-only torch state-dict file (torch.load(weights_only=True) "
            f"failed: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}); save "
            "model.state_dict() with torch.save"
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
        f"{', '.join(names)}; found keys {', '.join(map(str, list(obj)[:_SHOW]))}"
    )


def _strip_prefix(state: Mapping[str, Any], expected: Mapping[str, Any]) -> Mapping[str, Any]:
    """Accept a state dict saved from the Float16Module/DDP wrapper ('module.' prefixed keys)."""
    prefix = "module."
    if state and all(k.startswith(prefix) for k in state) and not any(k.startswith(prefix) for k in expected):
        return {k[len(prefix):]: v for k, v in state.items()}
    return state


def _load_file(modules: list[torch.nn.Module], path: Path, strict: bool) -> None:
    states = _read_state_dicts(path, len(modules))
    plans = []
    missing: list[str] = []
    unexpected: list[str] = []
    shapes: list[str] = []
    for index, (module, state) in enumerate(zip(modules, states)):
        expected = module.state_dict()
        state = _strip_prefix(state, expected)
        tag = f"model{index}." if len(modules) > 1 else ""
        # _extra_state entries are metadata (e.g. fp8 scaling), not weights: never required
        missing += [tag + k for k in expected if k not in state and not k.endswith("_extra_state")]
        unexpected += [tag + k for k in state if k not in expected]
        shapes += [
            _format_shape(tag + k, v.shape, expected[k].shape)
            for k, v in state.items()
            if k in expected and isinstance(v, torch.Tensor) and isinstance(expected[k], torch.Tensor)
            and v.shape != expected[k].shape
        ]
        plans.append((module, {k: v for k, v in state.items() if k in expected}))
    _check_fit(path, missing, unexpected, shapes, strict)
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
    state-dict file. Raises WeightsMismatchError (a ValueError listing the first offending keys)
    before copying anything when the checkpoint does not fit.
    """
    modules = [unwrap(chunk) for chunk in module_chunks(model, "model")]
    kind, path, found = resolve_checkpoint(load_dir, iteration)
    with torch.no_grad():
        if kind == "dist":
            _load_dist(modules, path, bool(strict))
        else:
            _load_file(modules, path, bool(strict))
    logger.info("megatron-rl-patches: loaded weights only from %s (iteration %d)", path, found)
    return found


