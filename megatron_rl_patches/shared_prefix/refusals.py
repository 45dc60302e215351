"""What a shared-prefix plan can run on, decided before a pass begins and agreed over the ranks.

A plan runs only what it knows to be exact; anything else is refused by name:
- every field of each model config (TransformerConfig, MLATransformerConfig) and the language
  model's position embedding hold a value `known_config.FIELDS` runs exact (a field it does not know
  runs only at its default);
- every module is read through the model kinds (`kinds.model_kinds()`): a kind that recognizes its
  code says what of it the plan refuses; a module no kind recognizes whose forward may be handed
  `packed_seq_params` (a parameter of that name, or `**kwargs`) reads the packed sequences itself and
  is refused by its class: a forward of its own, or an `__init__` of its own under a kind whose
  planned route stands in for the module's arithmetic (a core that sets its own softmax scale). A
  fallback kind names what it refuses by the class's name (Mamba, a recurrent layer no kind runs).
The layer kinds differ between pipeline stages, so the reasons are agreed over the group before
anything else: one rank's reason is every rank's."""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, cast

from megatron_rl_patches.model.chunks import as_chunks, modules_of
from megatron_rl_patches.model.kinds import is_language_model, qualified_name
from megatron_rl_patches.ops.agreement import gathered_objects, world
from megatron_rl_patches.shared_prefix.kinds import model_kinds
from megatron_rl_patches.shared_prefix.kinds.kind import ByCode, owner, reads_packed_sequences
from megatron_rl_patches.shared_prefix.kinds.latent_attention import megatron_core_before_0_16
from megatron_rl_patches.shared_prefix.known_config import FIELDS, Settings, refusal, unknown
from megatron_rl_patches.shared_prefix.prepared import own_class

NOT_KNOWN = ("a module the plan does not know ({name} at {path} takes packed_seq_params: what it reads of them is "
             "its own)")
OWN_INIT = ("a module the plan does not know ({name} at {path} takes packed_seq_params and sets itself up in an "
            "__init__ of its own ({init}): the plan would run it as a {kind} ({forward}'s), without what that "
            "__init__ sets")
HAND_WRITTEN = ("do not pack its micro-batches by shared prefix (call plan_shared_prefix only for models "
                "check_shared_prefix accepts)")


@functools.cache
def _defaults() -> dict[str, Any]:
    """TransformerConfig's (and MLATransformerConfig's) defaults: what a config without a field means."""
    try:
        # lazy: optional dependency megatron-core
        from megatron.core.transformer.transformer_config import MLATransformerConfig
    except ImportError:
        return {}
    return {name: value for name, value in _field_defaults(MLATransformerConfig).items() if value is not _NONE}


_NONE = object()  # a field without a default


def _field_defaults(cls: type) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for field in dataclasses.fields(cls):
        if field.default is not dataclasses.MISSING:
            out[field.name] = field.default
        elif field.default_factory is not dataclasses.MISSING:
            out[field.name] = field.default_factory()
        else:
            out[field.name] = _NONE
    return out


def _differs(value: Any, default: Any) -> bool:
    try:
        return bool(value != default)
    except Exception:  # a value that does not compare (a tensor): not the default
        return True


def config_reasons(config: Any, training: bool, position_embedding_type: str | None = None) -> list[str]:
    """Why a model of `config` (and that position embedding) cannot run a plan (`training`: with
    gradients), by field, in the config's order; empty when it can."""
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        values = {field.name: getattr(config, field.name) for field in dataclasses.fields(config)}
        own_defaults = _field_defaults(type(config))
    else:
        values, own_defaults = dict(vars(config)), {}
    if position_embedding_type is not None:
        values["position_embedding_type"] = position_embedding_type
    settings = Settings(config, {**_defaults(), **values})
    reasons = []
    for name, value in values.items():
        known = FIELDS.get(name)
        if known is not None:
            if not known.check(value, settings, training):
                reasons.append(refusal(name, value, known))
            continue
        default = own_defaults.get(name, _defaults().get(name, _NONE))
        if default is _NONE or _differs(value, default):
            reasons.append(unknown(name, value, None if default is _NONE else default))
    return reasons


def config_reason(config: Any, training: bool) -> str | None:
    """Why a model of `config` cannot run a plan (`training`: with gradients), or None."""
    return "; ".join(config_reasons(config, training)) or None


def module_reason(path: str, module: Any) -> str | None:
    """Why the plan cannot run a model holding `module` (at `path`), or None."""
    where = path or "the model"
    kinds = model_kinds()
    knowing = [kind for kind in kinds if not kind.fallback and kind.recognizes(module)]
    if not knowing:
        knowing = [kind for kind in kinds if kind.fallback and kind.recognizes(module)]
    for kind in knowing:
        refused = kind.reason(module, where)
        if refused is not None:
            return refused
    own = own_class(type(module))
    if knowing or not reads_packed_sequences(own):
        return None
    name = qualified_name(own)
    runs = next((kind for kind in kinds if isinstance(kind, ByCode) and kind.knows_forward(module)), None)
    if runs is None:
        return NOT_KNOWN.format(name=name, path=where)
    return OWN_INIT.format(name=name, path=where, init=qualified_name(owner(own, "__init__")), kind=runs.name,
                           forward=qualified_name(owner(own, "forward")))


def config_refusal(model: Any, training: bool) -> str | None:
    """What of a language model's own config (its position embedding with it) the plan refuses
    (`training`: with gradients), joined; None when it runs. The same words on every rank, which all
    hold the same config: a prepared model's first planned call raises them (`kinds.language_models`)."""
    return "; ".join(config_reasons(model.config, training, getattr(model, "position_embedding_type", None))) or None


def context_parallel_reasons(model: Any, path: str) -> list[str]:
    """Why a language model at context parallelism cannot run a plan: the rotary table is kept whole for
    the plan through megatron-core 0.16's `packed_seq_params.cp_group`, which only its GPTModel reads."""
    size = int(getattr(model.config, "context_parallel_size", 1) or 1)
    if size == 1:
        return []
    old = megatron_core_before_0_16()
    if old:
        return [f"context parallelism on megatron-core {old} (context_parallel_size={size}): the plan "
                "cuts its stream over the ranks on 0.16 and later; upgrade megatron-core or run it at "
                "context_parallel_size=1"]
    name = qualified_name(type(model))
    if type(model).__name__ != "GPTModel":
        return [f"context parallelism in {name} at {path or 'the model'} (context_parallel_size={size}): the plan "
                "cuts its stream over the ranks in megatron-core's GPTModel only; run it at context_parallel_size=1"]
    return []


def local_reasons(model: Any, training: bool) -> list[str]:
    """Why this rank's chunks of `model` cannot run a plan (one reason per refused field or class)."""
    reasons: list[str] = []
    seen: set[int] = set()  # the configs and module classes already read
    found = False
    chunks = as_chunks(model)
    for index, chunk in enumerate(chunks):
        next(modules_of(chunk, "prepare_shared_prefix"), None)  # a TypeError naming what is not a model chunk
        for path, module in chunk.named_modules():
            where = f"chunk {index}: {path}" if len(chunks) > 1 else path
            if id(type(module)) not in seen:
                seen.add(id(type(module)))
                refused = module_reason(where, module)
                reasons += [refused] if refused is not None else []
            if is_language_model(module):
                found = True
                seen.add(id(module.config))
                reasons += config_reasons(module.config, training, getattr(module, "position_embedding_type", None))
                reasons += context_parallel_reasons(module, where)
            config = getattr(module, "config", None)
            if id(config) not in seen and dataclasses.is_dataclass(config) and not isinstance(config, type):
                seen.add(id(config))
                reasons += config_reasons(config, training)
    if not found:
        reasons.append("no megatron-core language model (GPTModel, HybridModel) in the model chunks")
    return list(dict.fromkeys(reasons))


def local_reason(model: Any, training: bool) -> str | None:
    """Why this rank's chunks of `model` cannot run a plan, or None."""
    return "; ".join(local_reasons(model, training)) or None


def shared_prefix_reason(model: Any, *, training: bool, group: Any = None) -> str | None:
    """Why `model` cannot run a shared-prefix plan on some rank of `group` (None: the world when
    torch.distributed is initialized), the same answer on every rank; None when every rank can.
    Call it before the pass's first collective."""
    gathered = gathered_objects(group if group is not None else world(), local_reasons(model, training))
    named = sorted({str(reason) for reasons in gathered for reason in cast(list, reasons or [])})
    return "; ".join(named) if named else None


def check_shared_prefix(model: Any, *, training: bool, group: Any = None) -> None:
    """`shared_prefix_reason`, raised as a ValueError on every rank when there is one (for a
    hand-written loop: its remedy is not to plan that model's micro-batches)."""
    reason = shared_prefix_reason(model, training=training, group=group)
    if reason is not None:
        raise ValueError(f"shared-prefix packing cannot run this model: {reason}. {HAND_WRITTEN[0].upper()}"
                         f"{HAND_WRITTEN[1:]}")
