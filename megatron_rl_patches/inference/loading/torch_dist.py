"""Weights-only reads of a torch_dist checkpoint on megatron-core 0.13 to 0.19: the default
sharded load strategy between `load_preprocess` and `apply_factory_merges`, so the common state
(common.pt, pickled training args) is never read. Everything is checked first (metadata, model
fit, storage file lengths); tensors are then staged on CPU in bounded batches and copied in."""
# lazy imports: optional dependency megatron-core
from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import CheckpointException, FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from megatron_rl_patches.inference.loading.errors import (
    CheckpointReadError,
    check_fit,
    checkpoint_json,
    copying_into_model,
    describe,
    shown,
)
from megatron_rl_patches.inference.loading.paths import DIST_METADATA
from megatron_rl_patches.ops import agreement

# checkpoint keys that are not model weights: a training checkpoint holds them beside the model
_NON_MODEL_PREFIXES = ("optimizer.", "rng_state", "rerun_state_machine_state")
DCP_INDEX = ".metadata"  # torch.distributed.checkpoint's index: shapes, files, offsets
# Host memory for one batch of staged tensors (a single larger tensor gets a batch of its own).
STAGING_BYTES = 1 << 30


class _ShardedKeys:
    """The ShardedTensor / ShardedObject keys a (nested) sharded state dict holds, after
    applying sharded-tensor factories (which save under keys of their own)."""

    def __init__(self, value: Any):
        self.tensors: dict[str, tuple[tuple[int, ...], bool]] = {}
        self.objects: set[str] = set()
        self.object_shards: set[str] = set()  # ShardedObject.unique_key: the name DCP stores it under
        self.nbytes = 0
        self._walk(value)

    def _walk(self, value: Any) -> None:
        from megatron.core.dist_checkpointing.dict_utils import nested_values
        from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory

        # nested_values: the same dict / list nesting dist_checkpointing itself walks
        for item in nested_values(value) if isinstance(value, (dict, list)) else (value,):
            if isinstance(item, ShardedTensorFactory):
                self._walk(item.build())
            elif isinstance(item, ShardedTensor):
                self.tensors[item.key] = (tuple(item.global_shape), bool(item.allow_shape_mismatch))
                self.nbytes += item.data.nbytes if isinstance(item.data, torch.Tensor) else 0
            elif isinstance(item, ShardedObject):
                self.objects.add(item.key)
                self.object_shards.add(item.unique_key)

    def all(self) -> set[str]:
        return set(self.tensors) | self.objects


# ---------------------------------------------------------------------------- metadata


def _read_config(path: Path) -> None:
    """metadata.json must be a JSON object naming the torch_dist backend."""
    config_file = path / DIST_METADATA
    config = checkpoint_json(config_file)
    backend = config.get("sharded_backend") if isinstance(config, dict) else None
    if not isinstance(backend, str):
        raise CheckpointReadError(config_file, f"{DIST_METADATA} names no sharded_backend (found {config!r:.200})")
    if backend != "torch_dist":
        raise ValueError(
            f"{str(path)!r} is a {backend!r} dist checkpoint; weights-only loading reads torch_dist "
            "only: convert it (Megatron-LM: --ckpt-convert-format torch_dist)"
        )


def _read_index(path: Path) -> Any:
    """torch.distributed.checkpoint's Metadata (tensor shapes, storage files and byte ranges)."""
    index_file = path / DCP_INDEX
    if not index_file.is_file():
        raise CheckpointReadError(index_file, f"{DCP_INDEX} is missing (the save did not finish?)")
    try:
        return FileSystemReader(str(path)).read_metadata()
    except Exception as exc:  # a damaged pickle fails in many ways
        raise CheckpointReadError(index_file, f"{DCP_INDEX} is unreadable ({describe(exc)})") from exc


def _checkpoint_keys(index: Any) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """Tensor keys with global shapes, and ShardedObject keys, as the index lists them."""
    tensors, objects = {}, set()
    for key, item in index.state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata):
            tensors[key] = tuple(item.size)
        elif isinstance(item, BytesStorageMetadata):
            objects.add(key.rsplit("/shard_", 1)[0])  # ShardedObject.unique_key: <key>/shard_<offset>_<shape>
    return tensors, objects


def _check_storage(path: Path, index: Any, wanted: _ShardedKeys) -> None:
    """Every storage file holding a wanted tensor or object exists and is long enough for its
    byte ranges (a truncated copy or an unfinished save fails here, before anything is copied)."""
    storage = getattr(index, "storage_data", None)
    if not isinstance(storage, dict):
        return  # not a filesystem index: nothing to measure
    needed: dict[str, int] = {}
    for item, info in storage.items():
        fqn = getattr(item, "fqn", None)
        if fqn in wanted.tensors or fqn in wanted.object_shards:
            end = int(info.offset) + int(info.length)
            needed[info.relative_path] = max(end, needed.get(info.relative_path, 0))
    problems = []
    for name, end in sorted(needed.items()):
        file = path / name
        size = file.stat().st_size if file.is_file() else None
        if size is None:
            problems.append(f"{name} is missing")
        elif size < end:
            problems.append(f"{name} holds {size:,} bytes, the index reads up to byte {end:,} (truncated)")
    if problems:
        raise CheckpointReadError(path, f"{len(problems)} storage file(s) unusable: {shown(problems)}")


def _fit(path: Path, index: Any, wanted: _ShardedKeys, strict: bool) -> list[str]:
    """Missing keys (tolerated when not strict) after the fit check; raises WeightsMismatchError."""
    ckpt_tensors, ckpt_objects = _checkpoint_keys(index)
    missing = sorted(k for k in wanted.tensors if k not in ckpt_tensors) + sorted(
        k for k in wanted.objects if k not in ckpt_objects
    )
    shapes = sorted(
        f"{k} (checkpoint {ckpt_tensors[k]}, model {shape})"
        for k, (shape, vocab_padded) in wanted.tensors.items()
        if k in ckpt_tensors and not _shapes_fit(ckpt_tensors[k], shape, vocab_padded)
    )
    # With pipeline parallelism each rank holds only its stages' keys: the rest are not "unexpected".
    unexpected = (
        []
        if _pipeline_parallel()
        else sorted(k for k in ckpt_tensors if k not in wanted.tensors and not k.startswith(_NON_MODEL_PREFIXES))
    )
    check_fit(path, missing, unexpected, shapes, strict)
    return missing


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


# ---------------------------------------------------------------------------- staged reads


def _units(request: dict[str, dict]) -> list[tuple[list[tuple[str, str]], int]]:
    """Groups of (chunk, state key) entries that must be read in one call, with their bytes: all
    shards one rank holds of a checkpoint key (e.g. one weight of every layer, saved stacked) go
    to torch as one ShardedTensor. Entries sharing a key are joined (union-find)."""
    entries = [(name, key) for name, state in request.items() for key in state]
    parent = list(range(len(entries)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    first: dict[str, int] = {}  # checkpoint key -> first entry holding it
    sizes = []
    for i, (name, key) in enumerate(entries):
        keys = _ShardedKeys(request[name][key])
        sizes.append(keys.nbytes)
        for k in keys.all():
            if k in first:
                parent[root(i)] = root(first[k])
            else:
                first[k] = i
    groups: dict[int, tuple[list[tuple[str, str]], int]] = {}
    for i, entry in enumerate(entries):  # in request order, by first member
        members, size = groups.get(root(i), ([], 0))
        groups[root(i)] = (members + [entry], size + sizes[i])
    return list(groups.values())


def _batches(request: dict[str, dict], budget: int) -> list[dict[str, dict]]:
    """Split {chunk: {state key: sharded item}} into batches of about `budget` bytes (per rank);
    a unit (see _units) is never split, and its factory parts merge back after the read."""
    batches: list[dict[str, dict]] = []
    current: dict[str, dict] = {}
    size = 0
    for entries, nbytes in _units(request):
        if current and size + nbytes > budget:
            batches.append(current)
            current, size = {}, 0
        for name, key in entries:
            current.setdefault(name, {})[key] = request[name][key]
        size += nbytes
    if current:
        batches.append(current)
    return batches


def _agree(count: int, failed: bool) -> tuple[int, list[int]]:
    """(the most batches any rank has, the ranks whose checks failed). megatron-core < 0.19 reads
    collectively (a DCP load per call on every rank): ranks with fewer batches make empty calls,
    and a rank whose checks failed must stop the others before they wait for it."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return count, [0] if failed else []
    every = agreement.agree(agreement.world(), "read a torch_dist checkpoint",
                            share={"count": count, "failed": failed})
    return int(max(m["count"] for m in every)), [rank for rank, m in enumerate(every) if m["failed"]]


@contextlib.contextmanager
def _quiet_default_strategy() -> Iterator[None]:
    """megatron-core 0.17/0.18 log a deprecation warning for get_default_load_sharded_strategy,
    which is the one entry point that exists (and reads no common state) from 0.13 to 0.19."""
    log = logging.getLogger("megatron.core.dist_checkpointing.serialization")

    def quiet(record: logging.LogRecord) -> bool:
        return "get_default_load_sharded_strategy" not in record.getMessage()

    log.addFilter(quiet)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            yield
    finally:
        log.removeFilter(quiet)


def _default_strategy(path: Path) -> Any:
    from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy

    with _quiet_default_strategy():
        return get_default_load_sharded_strategy(str(path))


def _read_staged(strategy: Any, batch: dict[str, dict], path: Path) -> dict[str, dict]:
    """Read one batch into fresh CPU tensors (never into the model): the steps of
    dist_checkpointing.load without its common-state read."""
    from megatron.core.dist_checkpointing.dict_utils import merge, nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factory_merges
    from megatron.core.dist_checkpointing.state_dict_utils import load_preprocess

    sharded, result, factories = load_preprocess(batch)  # a copy: factories built, non-persistent split off
    for item in nested_values(sharded):
        if isinstance(item, ShardedTensor) and isinstance(item.data, torch.Tensor):
            item.data = torch.empty(item.data.shape, dtype=item.data.dtype, device="cpu")
    merge(result, strategy.load(sharded, str(path)))
    return apply_factory_merges(result, factories)


def _check_state_keys(modules: list[torch.nn.Module], names: list[str], request: dict[str, dict]) -> None:
    """Each requested entry must name a state_dict entry: load_state_dict(strict=False) on a
    batch would otherwise drop it silently."""
    for index, (module, name) in enumerate(zip(modules, names)):
        stray = sorted(set(request[name]) - set(module.state_dict(keep_vars=True)))
        if stray:
            raise RuntimeError(
                f"model chunk {index}: sharded_state_dict() entries with no state_dict() counterpart "
                f"({shown(stray)}); this model type cannot be loaded weights-only"
            )


def _prepare(modules: list[torch.nn.Module], names: list[str], path: Path,
             strict: bool) -> tuple[Any, list[dict[str, dict]]]:
    """Every check that needs no tensor data; the load strategy and the read batches."""
    _read_config(path)
    index = _read_index(path)
    # Built once: the key walk only reads it, the load request is this same dict minus missing keys.
    sharded = {name: cast(Any, module).sharded_state_dict() for name, module in zip(names, modules)}
    missing = _fit(path, index, _ShardedKeys(sharded), strict)
    request = {name: _drop_keys(state, set(missing)) for name, state in sharded.items()}
    _check_state_keys(modules, names, request)
    _check_storage(path, index, _ShardedKeys(request))
    return _default_strategy(path), _batches(request, STAGING_BYTES)


def load_dist(modules: list[torch.nn.Module], names: list[str], path: Path, strict: bool) -> None:
    """Load `modules` (chunk state under `names`) from the torch_dist checkpoint at `path`."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "loading a torch_dist checkpoint needs torch.distributed initialized (the same process "
            "groups the model was built under); initialize it first"
        )
    batches: list[dict[str, dict]]
    strategy, batches = None, []
    failure: Exception | None = None
    try:
        strategy, batches = _prepare(modules, names, path, strict)
    except Exception as exc:  # raised after every rank has heard of it
        failure = exc
    count, failed_ranks = _agree(len(batches), failure is not None)
    if failure is not None:
        raise failure
    if failed_ranks:
        raise CheckpointReadError(path, f"rank(s) {failed_ranks} could not use it (their own errors say why)")
    for step in range(count):
        try:
            loaded = _read_staged(strategy, batches[step] if step < len(batches) else {}, path)
        except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
            raise CheckpointReadError(
                path, f"reading tensors failed ({describe(exc)})", weights_undefined=step > 0
            ) from exc
        with copying_into_model(path):
            for name, module in zip(names, modules):
                if loaded.get(name):
                    module.load_state_dict(loaded[name], strict=False)
