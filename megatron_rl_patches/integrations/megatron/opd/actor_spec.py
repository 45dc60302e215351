"""The attention core of the actor's own layer spec (Megatron's `--spec MODULE NAME`, read as
slime's model provider reads it: a spec, or a function of (args, config, vp_stage) returning one),
so a Hugging Face teacher built beside an actor on a custom local spec runs the core the actor runs:
the one that serves slime's packed `thd` batches there (megatron-core's local one refuses them)."""
# lazy imports: optional dependency megatron-core
from __future__ import annotations

import importlib
import inspect
from typing import Any

from megatron_rl_patches._log import warn_once


def spec_pair(args: Any) -> tuple[str, str] | None:
    """(module, name) of the actor's `--spec`; None without one, or for Megatron's `--spec local`."""
    spec = getattr(args, "spec", None)
    if spec is None or isinstance(spec, str) or len(spec) != 2:
        return None
    module, name = spec
    return str(module), str(name)


def actor_layer_spec(args: Any) -> Any:
    """The actor's `--spec` object, called as slime calls a function there (the actor's
    TransformerConfig from its arguments, no virtual stage); None without a `--spec` pair."""
    pair = spec_pair(args)
    if pair is None:
        return None
    module, name = pair
    try:
        spec = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"--spec {module} {name}: the actor's layer spec cannot be imported ({exc}); "
                         "name a module on the path and a spec or spec function in it") from None
    from megatron.core.transformer.spec_utils import ModuleSpec

    if callable(spec) and not isinstance(spec, ModuleSpec):  # a ModuleSpec is callable too (it builds its module)
        from megatron.training.arguments import core_transformer_config_from_args

        spec = spec(args, core_transformer_config_from_args(args), None)
    return spec


def _layers(spec: Any) -> list[Any]:
    """The layer specs of a layer spec or a block spec (bare, or a ModuleSpec around one)."""
    block = getattr(spec, "layer_specs", None)
    if block is None:
        block = getattr(getattr(spec, "submodules", None), "layer_specs", None)
    return list(block) if block else [spec]


def _core_class(layer: Any) -> Any:
    """The core attention class of one layer spec (None where it has none to read)."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    attention = getattr(getattr(layer, "submodules", None), "self_attention", None)
    core = getattr(getattr(attention, "submodules", None), "core_attention", None)
    if isinstance(core, ModuleSpec) and isinstance(core.module, type) and not core.params:
        core = core.module  # a spec that only names the class
    return core if isinstance(core, type) else None


def spec_core_attention(spec: Any, what: str = "the actor's --spec") -> type | None:
    """The attention core class every self-attention layer of `spec` uses (a layer spec, a block
    spec or a ModuleSpec around one); None, with a warning naming `what`, where none can be read
    (a model provider, a spec without self-attention, layers of different cores)."""
    if spec is None:
        return None
    if callable(spec) and not isinstance(spec, type) and "pre_process" in _parameters(spec):
        found: set[Any] = set()  # a model provider: its layers are not known before it builds
    else:
        found = {_core_class(layer) for layer in _layers(spec)}
    if len(found) == 1 and None not in found:
        return found.pop()
    names = ", ".join(sorted(getattr(core, "__name__", str(core)) for core in found)) or "a model provider"
    warn_once(f"{what} gives no single attention core class to read ({names}): Hugging Face teachers run "
              "megatron-core's local attention core, which refuses packed (thd) batches")
    return None


def _parameters(function: Any) -> list[str]:
    try:
        return list(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return []
