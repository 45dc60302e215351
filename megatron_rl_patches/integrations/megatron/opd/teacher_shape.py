"""The shape of a Hugging Face teacher against a Megatron actor, field by field (framework-free:
slime's route reads it): the teacher's as the converter reads its config.json (its family's
`HFArchitecture`: experts however the family names them, multi-latent attention's widths), the
actor's from its Megatron arguments. A config.json the
converter refuses gives the sizes every decoder writes alike (the route then refuses it by name
where it differs from the actor)."""
from __future__ import annotations

from typing import Any

from megatron_rl_patches.inference.loading.hf.architecture import HFArchitecture
from megatron_rl_patches.inference.loading.hf.checkpoint_config import text_config
from megatron_rl_patches.inference.loading.hf.families import architecture

# The model-shaping fields compared, in the order differences are named (config.json's names;
# None on either side: not compared).
SHAPE_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                "intermediate_size", "num_experts", "moe_intermediate_size", "vocab_size", "qk_norm", "qkv_bias",
                "tie_word_embeddings", "rope_theta", "rms_norm_eps", "partial_rotary_factor", "num_experts_per_tok",
                "shared_expert_intermediate_size", "first_k_dense_replace", "multi_latent_attention", "q_lora_rank",
                "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def served_architecture(config: dict[str, Any]) -> HFArchitecture | None:
    """The converter's architecture of `config` (its family's reading), None where it refuses it."""
    try:
        return architecture(config)
    except ValueError:  # UnsupportedCheckpointError too: the route decision names it later
        return None


def architecture_shape(arch: HFArchitecture) -> dict[str, Any]:
    """The shaping fields of a teacher as the converter builds it (MLA: the latent norms on, its
    value width the kv channels, as the converter's MLATransformerConfig sets them)."""
    mla, moe = arch.mla, arch.is_moe
    shape: dict[str, Any] = {
        "hidden_size": arch.hidden_size, "num_hidden_layers": arch.num_layers,
        "num_attention_heads": arch.num_heads, "num_key_value_heads": arch.num_kv_heads,
        "head_dim": arch.head_dim if mla is None else mla.v_head_dim,
        # the dense MLP's width: every layer's, or the first dense layers' of a mixture of experts
        "intermediate_size": arch.ffn_hidden_size if not moe or arch.dense_layers else None,
        "num_experts": arch.num_experts, "moe_intermediate_size": arch.expert_ffn_hidden_size if moe else None,
        "vocab_size": arch.vocab_size, "qk_norm": arch.qk_norm or mla is not None, "qkv_bias": arch.qkv_bias,
        "tie_word_embeddings": arch.tied, "rope_theta": arch.rope_theta, "rms_norm_eps": arch.norm_eps,
        "partial_rotary_factor": arch.rope.partial,
        "num_experts_per_tok": arch.experts_per_token if moe else None,
        "shared_expert_intermediate_size": arch.shared_expert_ffn if moe else None,
        "first_k_dense_replace": arch.dense_layers if moe else None,
        "multi_latent_attention": mla is not None,
    }
    if mla is not None:
        shape.update(q_lora_rank=mla.q_lora_rank or 0, kv_lora_rank=mla.kv_lora_rank,
                     qk_nope_head_dim=mla.qk_nope_head_dim, qk_rope_head_dim=mla.qk_rope_head_dim,
                     v_head_dim=mla.v_head_dim)
    return shape


def unserved_shape(fields: dict[str, Any]) -> dict[str, Any]:
    """The sizes of a config.json the converter refuses (another family, a feature it does not map),
    a wrapper's read from its text model: their norms, biases and latent widths are not compared."""
    config = text_config(fields)
    heads = config.get("num_attention_heads")
    experts = config.get("num_experts") or config.get("num_local_experts") or 0
    rope = config.get("rope_parameters")
    rope = rope if isinstance(rope, dict) else {}  # another type: the architecture check names the field
    shape: dict[str, Any] = {
        "hidden_size": config.get("hidden_size"),
        "num_hidden_layers": config.get("num_hidden_layers"),
        "num_attention_heads": heads,
        "num_key_value_heads": config.get("num_key_value_heads") or heads,
        "head_dim": config.get("head_dim") or (config["hidden_size"] // heads
                                                if config.get("hidden_size") and heads else None),
        "intermediate_size": None if experts else config.get("intermediate_size"),
        "num_experts": experts,
        "moe_intermediate_size": config.get("moe_intermediate_size") if experts else None,
        "vocab_size": config.get("vocab_size"),
        # not shapes, but the snapshot route would run the teacher with the actor's values
        "rope_theta": rope.get("rope_theta") or config.get("rope_theta"),
        "rms_norm_eps": config.get("rms_norm_eps"),
    }
    if "tie_word_embeddings" in config:  # compared where written
        shape["tie_word_embeddings"] = bool(config["tie_word_embeddings"])
    return shape


def teacher_shape(fields: dict[str, Any]) -> dict[str, Any]:
    """The shaping fields of a config.json dict: the converter's reading where it serves it."""
    arch = served_architecture(fields)
    return unserved_shape(fields) if arch is None else architecture_shape(arch)


def _dense_layers(freq: Any) -> Any:
    """How many first layers are dense under Megatron's --moe-layer-freq (an int: one expert layer
    every N; a list: 1 = experts, 0 = dense), or the pattern where it is not first-k-dense."""
    if isinstance(freq, int) and not isinstance(freq, bool):
        return 0 if freq == 1 else f"--moe-layer-freq {freq}"
    if isinstance(freq, (list, tuple)):
        dense = next((i for i, kind in enumerate(freq) if kind), len(freq))
        return dense if all(freq[dense:]) else f"--moe-layer-freq {list(freq)}"
    return None


def actor_shape(args: Any) -> dict[str, Any]:
    """The same fields from the actor's Megatron arguments (e.g. slime's args)."""
    heads = getattr(args, "num_attention_heads", None)
    groups = getattr(args, "num_query_groups", None) if getattr(args, "group_query_attention", False) else None
    experts = getattr(args, "num_experts", None) or 0
    hidden = getattr(args, "hidden_size", None)
    mla = bool(getattr(args, "multi_latent_attention", False))
    shape: dict[str, Any] = {
        "hidden_size": hidden,
        "num_hidden_layers": getattr(args, "num_layers", None),
        "num_attention_heads": heads,
        "num_key_value_heads": groups or heads,
        "head_dim": getattr(args, "kv_channels", None) or (hidden // heads if hidden and heads else None),
        "intermediate_size": getattr(args, "ffn_hidden_size", None),
        "num_experts": experts,
        "moe_intermediate_size": getattr(args, "moe_ffn_hidden_size", None) if experts else None,
        "vocab_size": getattr(args, "vocab_size", None),
        "tie_word_embeddings": not getattr(args, "untie_embeddings_and_output_weights", False),
        "qkv_bias": bool(getattr(args, "add_qkv_bias", False)),
        "qk_norm": bool(getattr(args, "qk_layernorm", False)),
        "rope_theta": getattr(args, "rotary_base", None),
        "rms_norm_eps": getattr(args, "norm_epsilon", None),
        "partial_rotary_factor": getattr(args, "rotary_percent", None),
        "num_experts_per_tok": getattr(args, "moe_router_topk", None) if experts else None,
        "shared_expert_intermediate_size": (getattr(args, "moe_shared_expert_intermediate_size", None) or 0)
        if experts else None,
        "first_k_dense_replace": _dense_layers(getattr(args, "moe_layer_freq", 1)) if experts else None,
        "multi_latent_attention": mla,
    }
    if mla:
        shape.update(q_lora_rank=getattr(args, "q_lora_rank", None) or 0,
                     kv_lora_rank=getattr(args, "kv_lora_rank", None),
                     qk_nope_head_dim=getattr(args, "qk_head_dim", None),
                     qk_rope_head_dim=getattr(args, "qk_pos_emb_head_dim", None),
                     v_head_dim=getattr(args, "v_head_dim", None))
    return shape


def shape_differences(config: dict[str, Any], args: Any) -> list[str]:
    """'field: teacher X, actor Y' for each model-shaping field where a Hugging Face config and
    the actor differ (fields either side does not give are not compared)."""
    teacher, actor = teacher_shape(config), actor_shape(args)
    return [f"{name}: teacher {teacher[name]}, actor {actor[name]}" for name in SHAPE_FIELDS
            if teacher.get(name) is not None and actor.get(name) is not None and teacher[name] != actor[name]]
