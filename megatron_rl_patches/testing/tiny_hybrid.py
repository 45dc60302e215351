"""A tiny real HybridModel (megatron-core >= 0.18) of attention and MLP layers with local (non
Transformer Engine) modules, so it runs on CPU. Imported only by `build_tiny_hybrid`."""
from __future__ import annotations

from typing import Any

from megatron_rl_patches.testing.model_kinds import ModelKindUnavailable

try:
    from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
    from megatron.core.models.hybrid.hybrid_model import HybridModel
    from megatron.core.ssm.mlp_layer import MLPLayer
except ImportError as exc:  # megatron-core <= 0.17: only MambaModel / MambaStack
    from megatron.core import package_info

    raise ModelKindUnavailable(
        f"HybridModel needs megatron-core >= 0.18 (megatron.core.models.hybrid); "
        f"installed: {package_info.__version__}"
    ) from exc

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.core.transformer.multi_token_prediction import (
    MultiTokenPredictionBlock,
    MultiTokenPredictionBlockSubmodules,
    MultiTokenPredictionLayer,
    MultiTokenPredictionLayerSubmodules,
)
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

# the layer symbols that need no CUDA kernel: self-attention and a dense MLP
CPU_LAYER_SYMBOLS = {"*": "attention", "-": "MLP"}
MTP_SEPARATOR = "/"  # "main/mtp/mtp": one multi-token-prediction depth per segment after the first


class LocalNormHybridStack(HybridStack):
    """HybridStack with megatron-core's local final norm (upstream always builds Transformer
    Engine's `TENorm`, which needs CUDA); everything else is upstream's."""

    def __init__(
        self, config: Any, submodules: Any, *args: Any, final_norm: Any, post_layer_norm: bool = True, **kwargs: Any
    ) -> None:
        super().__init__(config, submodules, *args, post_layer_norm=False, **kwargs)
        self.post_layer_norm = post_layer_norm
        if self.post_process and post_layer_norm:
            self.final_norm = build_module(
                final_norm, config=config, hidden_size=config.hidden_size, eps=config.layernorm_epsilon
            )


def local_hybrid_stack_spec() -> ModuleSpec:
    """Attention layers and MLP layers built from megatron-core's local GPT layer spec."""
    local = get_gpt_layer_local_spec().submodules
    attention = TransformerLayerSubmodules(
        input_layernorm=local.input_layernorm,
        self_attention=local.self_attention,
        self_attn_bda=local.self_attn_bda,
    )
    mlp = TransformerLayerSubmodules(
        pre_mlp_layernorm=local.pre_mlp_layernorm, mlp=local.mlp, mlp_bda=local.mlp_bda
    )
    norm = local.input_layernorm
    # multi-token prediction (a pattern with "/"): norms and projection local; upstream builds each
    # depth's inner layers from the pattern with these same submodules
    mtp_layer = MultiTokenPredictionLayerSubmodules(
        enorm=norm, hnorm=norm, eh_proj=ColumnParallelLinear, mtp_model_layer=None, layer_norm=norm
    )
    mtp_block = ModuleSpec(
        module=MultiTokenPredictionBlock,
        submodules=MultiTokenPredictionBlockSubmodules(
            layer_specs=[ModuleSpec(module=MultiTokenPredictionLayer, submodules=mtp_layer)]
        ),
    )
    return ModuleSpec(
        module=LocalNormHybridStack,
        params={"final_norm": norm},
        submodules=HybridStackSubmodules(
            attention_layer=ModuleSpec(module=TransformerLayer, submodules=attention),
            mlp_layer=ModuleSpec(module=MLPLayer, submodules=mlp),
            mtp_block_spec=mtp_block,
        ),
    )


def check_pattern(layer_pattern: str, num_layers: int, mtp_num_layers: int | None = None) -> None:
    """ValueError unless the pattern has `num_layers` symbols, each attention or MLP, and after its
    main part one "/"-separated segment per MTP depth (`mtp_num_layers`)."""
    if not isinstance(layer_pattern, str) or not layer_pattern:
        raise TypeError(f"layer_pattern must be a non-empty str like '*-*-', got {layer_pattern!r}")
    main, *mtp = layer_pattern.split(MTP_SEPARATOR)
    others = sorted(set(layer_pattern) - set(CPU_LAYER_SYMBOLS) - {MTP_SEPARATOR})
    if others:
        raise ValueError(
            f"layer_pattern {layer_pattern!r} holds {others}: the CPU kit builds only "
            f"'*' (attention) and '-' (MLP) layers; Mamba, MoE and the rest need CUDA kernels"
        )
    if len(main) != num_layers:
        raise ValueError(
            f"layer_pattern {layer_pattern!r} has {len(main)} layers but config.num_layers is "
            f"{num_layers}: pass a config with num_layers={len(main)} or a pattern of that length"
        )
    if mtp and mtp_num_layers != len(mtp):
        raise ValueError(
            f"layer_pattern {layer_pattern!r} has {len(mtp)} MTP depths but config.mtp_num_layers is "
            f"{mtp_num_layers}: pass a config with mtp_num_layers={len(mtp)}"
        )


def build(config: Any, layer_pattern: str, **kwargs: Any) -> Any:
    """A HybridModel with the given attention/MLP pattern and learned absolute positions (as the tiny GPT)."""
    check_pattern(layer_pattern, config.num_layers, getattr(config, "mtp_num_layers", None))
    return HybridModel(
        config=config,
        hybrid_stack_spec=local_hybrid_stack_spec(),
        hybrid_layer_pattern=layer_pattern,
        position_embedding_type="learned_absolute",
        **kwargs,
    )
