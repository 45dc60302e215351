"""GLM-4.7-Flash (`model_type` glm4_moe_lite): DeepSeek-V3's layer (multi-latent attention, then a
dense MLP or glm4_moe's mixture of experts) with the dense and sparse layers listed in
`mlp_layer_types`; without it transformers makes the first layer dense and the others sparse
(whatever `first_k_dense_replace` says: another value is refused as ambiguous). Dense layers must
come first (megatron-core's moe_layer_freq pattern here)."""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from megatron_rl_patches.inference.loading.hf.architecture import HFArchitecture, read_count, refuse_unmapped
from megatron_rl_patches.inference.loading.hf.families import deepseek_v3


def dense_prefix(config: dict[str, Any], source: str) -> int:
    """How many first layers are dense (mlp_layer_types, else transformers' default of one)."""
    layers = read_count(config, source, "num_hidden_layers")
    types = config.get("mlp_layer_types")
    if types is None:
        if config.get("first_k_dense_replace", 1) != 1:
            refuse_unmapped(source, [f"first_k_dense_replace={config['first_k_dense_replace']!r} without "
                                     "mlp_layer_types (transformers then makes only the first layer dense)"])
        return 1
    dense = sum(1 for kind in types if kind == "dense") if isinstance(types, list) else 0
    if types != ["dense"] * dense + ["sparse"] * (layers - dense):
        refuse_unmapped(source, [f"mlp_layer_types={types!r} (one per layer, the dense ones first)"])
    return dense


def read(config: dict[str, Any], source: str) -> HFArchitecture:
    # transformers' GLM-4.7-Flash reads partial_rotary_factor (default 1.0): MLA refuses other values
    return deepseek_v3.read({**config, "first_k_dense_replace": dense_prefix(config, source)}, source, 1.0)


# first_k_dense_replace: transformers' class ignores it; refused where it contradicts the default layout
FAMILY = replace(deepseek_v3.FAMILY, name="glm4_moe_lite", hf_class="Glm4MoeLite", read=read, aliases=(),
                 fields=deepseek_v3.FAMILY.fields - {"scoring_func", "num_mtp_layers"} | {"mlp_layer_types"},
                 synonyms=(("n_routed_experts", "num_local_experts"), ("qk_rope_head_dim", "head_dim")))
