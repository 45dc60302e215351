"""What a shared-prefix plan can run on, decided before a pass begins and agreed over the ranks.

A plan runs only what it knows to be exact; anything else is refused by name:
- every field of each model config (TransformerConfig, MLATransformerConfig) and the language
  model's position embedding hold a value `known_config.FIELDS` runs exact (a field it does not know
  runs only at its default);
- every module whose forward takes `packed_seq_params` is one the package prepares or knows to pass
  them on unread (`PASSES_ON`: the language models, the transformer block and layer, megatron-core's
  attention) or a core attention the package's attention replaces with the same arithmetic
  (`CORES`), or megatron-core 0.19's DSA core and indexer, which the plan hands its rule
  (`sparse_attention`). Anything else reads the packed sequences itself (slime's
  `HuggingfaceAttention`, a gated delta net, Mamba, slime's GLM-5 DSA layer) and is refused by its
  class.
The layer kinds differ between pipeline stages, so the reasons are agreed over the group before
anything else: one rank's reason is every rank's."""
from __future__ import annotations

import dataclasses
import functools
import inspect
import re
from typing import Any, cast

from megatron_rl_patches.model.chunks import as_chunks, modules_of
from megatron_rl_patches.model.kinds import is_attention, is_language_model, qualified_name
from megatron_rl_patches.ops.agreement import gathered_objects, world
from megatron_rl_patches.shared_prefix.gated_delta_net import PlannedGatedDeltaNet
from megatron_rl_patches.shared_prefix.known_config import FIELDS, Settings, refusal, unknown
from megatron_rl_patches.shared_prefix.mla import is_latent_attention
from megatron_rl_patches.shared_prefix.model_hooks import SharedPrefixCore
from megatron_rl_patches.shared_prefix.slime_gated_delta_net import (
    LAYERS,
    is_slime_gated_delta_net,
    slime_gated_delta_net_reason,
)
from megatron_rl_patches.shared_prefix.sparse_attention import ATTENTION, is_sparse_attention, is_sparse_indexer
from megatron_rl_patches.shared_prefix.sparse_attention import module_reason as sparse_attention_reason

PASSES_ON = {  # the class that defines the forward: it hands packed_seq_params on, unread, or the package prepares it
    "megatron.core.models.gpt.gpt_model.GPTModel",
    "megatron.core.models.mamba.mamba_model.MambaModel",
    "megatron.core.models.hybrid.hybrid_model.HybridModel",
    "megatron.core.transformer.transformer_block.TransformerBlock",
    "megatron.core.transformer.transformer_layer.TransformerLayer",
    "megatron.core.ssm.mamba_block.MambaStack",
    "megatron.core.models.hybrid.hybrid_block.HybridStack",
    "megatron.core.transformer.attention.Attention",
    # prepared by the package: MLA's rotary length (shared_prefix/mla.py), each MTP depth's layer on its
    # own plan, the prompt shared one token shorter per depth (shared_prefix/mtp.py)
    "megatron.core.transformer.multi_latent_attention.MultiLatentAttention",
    "megatron.core.transformer.multi_token_prediction.MultiTokenPredictionBlock",
    "megatron.core.transformer.multi_token_prediction.MultiTokenPredictionLayer",
    ATTENTION,  # megatron-core 0.19's MLA for DSA: its rotary length prepared as MLA's (shared_prefix/mla.py)
}
CORES = {  # core attentions computing plain causal softmax attention from the config: the package's replaces them
    "megatron.core.transformer.dot_product_attention.DotProductAttention",
    "megatron.core.extensions.transformer_engine.TEDotProductAttention",
    "megatron_rl_patches.inference.sdpa_attention.SDPACoreAttention",
    "megatron_rl_patches.testing.packed_gpt.packed_attention_class.<locals>.PackedDotProductAttention",
    "megatron_rl_patches.testing.cp_attention.ContextParallelAttention",
}
RECURRENT = {"GatedDeltaNet": "Qwen3.5's gated delta net layers (each remainder would start from the prefix's final "
                              "recurrent state)",
             "MambaMixer": "Mamba layers (each remainder would start from the prefix's final state)"}
SLIME_SPARSE = {"DSAMultiLatentAttention": (
    "slime's GLM-5 DSA layer (its indexer and sparse MLA are tilelang CUDA kernels taking one contiguous key range "
    "[start, end) per query from cu_seqlens, where a planned row sees its ancestors' rows and its own)")}
PACKAGE_GATED_DELTA_NET = "megatron_rl_patches.inference.gated_delta_net.GatedDeltaNetLayer"
RECURRENT_SERVED = {  # recurrent layers whose forward the package runs planned (shared_prefix/gated_delta_net.py)
    "megatron.core.ssm.gated_delta_net.GatedDeltaNet",  # megatron-core 0.16's; 0.19's gdn.GatedDeltaNet is another
    PACKAGE_GATED_DELTA_NET,  # the package's (Hugging Face Qwen3.5's and Qwen3-Next's teachers)
    *LAYERS.values(),  # slime's, inside its layer (shared_prefix/slime_gated_delta_net.py)
}
NOT_KNOWN = ("a module the plan does not know ({name} at {path} takes packed_seq_params: what it reads of them is "
             "its own)")
HAND_WRITTEN = ("do not pack its micro-batches by shared prefix (call plan_shared_prefix only for models "
                "check_shared_prefix accepts)")


@functools.cache
def _forward_owner(cls: Any) -> str:
    """The class (qualified name) whose own code is `cls`'s forward."""
    owner = next((c for c in cls.__mro__ if "forward" in vars(c)), cls)
    return qualified_name(owner)


@functools.cache
def _takes_packed_seq_params(cls: Any) -> bool:
    try:
        return "packed_seq_params" in inspect.signature(cls.forward).parameters
    except (TypeError, ValueError, AttributeError):
        return False


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


@functools.cache
def _old_megatron_core() -> str | None:
    """megatron-core's version where it is older than 0.16 (its multi-latent attention fails inside its own
    rotary step on packed input, checked on 0.13.1), else None."""
    try:
        from megatron.core.package_info import __version__  # lazy: optional dependency megatron-core
    except ImportError:
        return None
    found = re.match(r"(\d+)\.(\d+)", str(__version__))
    return str(__version__) if found and (int(found[1]), int(found[2])) < (0, 16) else None


def module_reason(path: str, module: Any) -> str | None:
    """Why the plan cannot run a model holding `module` (at `path`), or None."""
    cls: Any = type(module)
    if is_latent_attention(module) and _old_megatron_core():
        return (f"multi-latent attention on megatron-core {_old_megatron_core()} ({qualified_name(cls)} at {path}): "
                "tested exact on 0.16 and later; upgrade megatron-core or do not share this model's prefixes")
    # a core or a gated delta net the package already prepared: the class it found
    own: Any = cls.__mro__[1] if isinstance(module, (SharedPrefixCore, PlannedGatedDeltaNet)) else cls
    for kind, reason in RECURRENT.items():
        if kind in cls.__name__ and _forward_owner(own) not in RECURRENT_SERVED:
            return f"{reason} ({qualified_name(cls)} at {path or 'the model'})"
    if is_sparse_attention(module):
        return sparse_attention_reason(module, path or "the model")
    for kind, reason in SLIME_SPARSE.items():
        if any(c.__name__ == kind for c in cls.__mro__):
            return f"{reason} ({qualified_name(cls)} at {path or 'the model'})"
    if is_sparse_indexer(module):  # its core prepares it (refused with the core where it cannot run)
        return None
    if is_attention(module) and getattr(module, "attention_type", "self") != "self":
        return f"{getattr(module, 'attention_type', '')} attention ({qualified_name(cls)} at {path})"
    if not _takes_packed_seq_params(cls):
        return None
    if is_slime_gated_delta_net(module):
        return slime_gated_delta_net_reason(module, path or "the model")
    if _forward_owner(own) == PACKAGE_GATED_DELTA_NET and int(getattr(module, "cp_size", 1)) > 1:
        return (f"the package's gated delta net ({qualified_name(cls)} at {path}) at context parallelism "
                f"(context-parallel size {module.cp_size}): it runs a plan's stream at one rank; run it at "
                "context_parallel_size=1")
    if is_language_model(module) or _forward_owner(own) in PASSES_ON | CORES | RECURRENT_SERVED:
        return None
    return NOT_KNOWN.format(name=qualified_name(cls), path=path or "the model")


def context_parallel_reasons(model: Any, path: str) -> list[str]:
    """Why a language model at context parallelism cannot run a plan: the rotary table is kept whole for
    the plan through megatron-core 0.16's `packed_seq_params.cp_group`, which only its GPTModel reads."""
    size = int(getattr(model.config, "context_parallel_size", 1) or 1)
    if size == 1:
        return []
    if _old_megatron_core():
        return [f"context parallelism on megatron-core {_old_megatron_core()} (context_parallel_size={size}): the plan "
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
