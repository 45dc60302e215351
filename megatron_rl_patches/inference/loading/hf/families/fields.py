"""The config.json fields a family's reader may see: those every family's transformers forward reads
(`SHARED`: sizes, norm epsilon, activation, RoPE, tied embeddings) and the family's own (`Family.fields`).
The reader is handed nothing else, so a field transformers ignores for that family (qwen2's
`attention_bias`, llama's `use_sliding_window`) cannot change the build; the family contract test
holds each family's set against transformers' modeling code."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

# what transformers' PreTrainedModel and config classes read for every family, and the RoPE fields its
# config class moves into rope_parameters (rope_scaling, rope_theta, partial_rotary_factor)
SHARED = frozenset({
    "model_type", "architectures", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "intermediate_size", "rms_norm_eps", "hidden_act", "max_position_embeddings",
    "tie_word_embeddings", "rope_parameters", "rope_scaling", "rope_theta", "partial_rotary_factor",
    "original_max_position_embeddings",
})
NESTED = "text_config"  # a vision-language wrapper's text model: its fields are seen as the wrapper's


def one_field(config: dict[str, Any], source: str, names: tuple[str, ...]) -> dict[str, Any]:
    """`config` with `names[0]` set where config.json writes the field under another of `names` (a
    name the family's transformers config class maps onto the same attribute, e.g. mixtral's
    num_experts -> num_local_experts); a ValueError naming both where they differ, as which one wins
    differs from one transformers config class to another."""
    given = {name: config[name] for name in names if config.get(name) is not None}
    if len({repr(value) for value in given.values()}) > 1:
        written = ", ".join(f"{name}={value!r}" for name, value in given.items())
        raise ValueError(f"{source}: config.json writes {written}: transformers reads these as one field; "
                         "keep one of them (or give them the same value)")
    return {**config, names[0]: next(iter(given.values()))} if given else config


def seen_by(config: dict[str, Any], source: str, fields: Iterable[str],
            synonyms: Iterable[tuple[str, ...]] = ()) -> dict[str, Any]:
    """What a family's reader is handed: the fields it reads (`visible`), each under one name."""
    seen = visible(config, fields)
    for names in synonyms:
        seen = one_field(seen, source, names)
    return seen


def visible(config: dict[str, Any], fields: Iterable[str]) -> dict[str, Any]:
    """`config` with only the SHARED fields and `fields` (inside a wrapper's text_config too)."""
    seen = SHARED | frozenset(fields)
    out = {name: value for name, value in config.items() if name in seen}
    if isinstance(out.get(NESTED), dict):
        out[NESTED] = {name: value for name, value in out[NESTED].items() if name in seen}
    return out


# groups of fields several families read
SLIDING = frozenset({"use_sliding_window", "sliding_window", "max_window_layers", "layer_types"})  # refused if on
ROUTED = frozenset({"num_experts", "num_experts_per_tok", "moe_intermediate_size"})  # a Qwen MoE's experts
GROUPED = frozenset({"first_k_dense_replace", "n_group", "topk_group", "n_routed_experts", "num_experts_per_tok",
                     "moe_intermediate_size", "n_shared_experts", "norm_topk_prob", "routed_scaling_factor",
                     "num_nextn_predict_layers", "num_local_experts", "num_mtp_layers"})  # GLM-4.5's, DeepSeek-V3's
