"""The Megatron side of a Hugging Face architecture: a TransformerConfig at the job's parallel
sizes (the family's overrides applied) and a model provider of the family's layer spec and model
class (by default megatron-core's local, non Transformer Engine, GPT spec and GPTModel)."""
# lazy imports: optional dependency megatron-core
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from megatron_rl_patches.inference.loading.hf.architecture import HFArchitecture, UnsupportedCheckpointError
from megatron_rl_patches.inference.loading.hf.families.common import after_init, stage_args
from megatron_rl_patches.inference.loading.hf.families.kv_heads import query_groups

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def checkpoint_dtype(own: Any, dtype: Any) -> torch.dtype:
    """`dtype` when given, else the checkpoint's own `own` (config.json's dtype / torch_dtype, a
    wrapper's text model's: CheckpointConfig.dtype), else fp32."""
    given = dtype
    if dtype is None:
        dtype = own or "float32"
    wanted = _DTYPES.get(dtype.removeprefix("torch.")) if isinstance(dtype, str) else dtype
    if isinstance(wanted, torch.dtype) and wanted in _DTYPES.values():
        return wanted
    if given is None:  # the checkpoint's own dtype is one the build does not serve
        raise ValueError(f"config.json's dtype is {dtype!r}: the build serves float32, bfloat16 and float16; pass "
                         "dtype=torch.bfloat16 (or float32 / float16) to convert the weights")
    raise ValueError(f"dtype must be torch.float32, torch.bfloat16 or torch.float16 (or None: the checkpoint's "
                     f"own), got {given!r}")


def padded_vocab(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Megatron-LM's vocab padding: up to a multiple of `divisible_by` x tensor-parallel size."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def local_spec_fields(dtype: torch.dtype) -> dict[str, Any]:
    """TransformerConfig fields of a checkpoint's model on megatron-core's local (non Transformer
    Engine) spec, for inference on any device: weights in `dtype`, made on the host and not
    initialized (every weight is overwritten by the checkpoint), no dropout, no fused kernels
    (bias-activation, masked softmax, persistent layer norm, RoPE, gradient accumulation), no
    sequence parallelism."""
    return dict(
        params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype is torch.bfloat16, fp16=dtype is torch.float16,
        use_cpu_initialization=True, perform_initialization=False, hidden_dropout=0.0, attention_dropout=0.0,
        sequence_parallel=False, bias_activation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False,
    )


def transformer_config(arch: HFArchitecture, dtype: torch.dtype, sizes: dict[str, Any] | None = None) -> Any:
    """megatron-core's TransformerConfig for `arch` at the parallel sizes of parallel_state, or at
    `sizes` (TransformerConfig's *_parallel_size fields, e.g. a teacher's own layout) where given."""
    from megatron.core import parallel_state

    values: dict[str, Any] = dict(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        ffn_hidden_size=arch.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=arch.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm,
        **local_spec_fields(dtype),
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        # with virtual pipeline stages each chunk must know them (its layers' offsets)
        virtual_pipeline_model_parallel_size=parallel_state.get_virtual_pipeline_model_parallel_world_size(),
        expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
        context_parallel_size=parallel_state.get_context_parallel_world_size(),
    )
    values.update(sizes or {})
    # the checkpoint's key/value heads, repeated where the tensor-parallel size exceeds them (kv_heads.py)
    values["num_query_groups"] = query_groups(arch, values["tensor_model_parallel_size"])
    family = arch.family
    values.update(family.config_overrides(arch))
    if arch.rope.kind == "yarn":
        _check_yarn_served(arch)
    config = family.config_class(arch)(**values)
    # YaRN's, which the dataclass does not declare, and values its checks refuse though exact in inference
    for name, value in {**arch.rope.config_attributes(), **after_init(arch)}.items():
        setattr(config, name, value)
    return config


def model_provider(arch: HFArchitecture, config: Any, vocab_size: int,
                   core_attention: type | None = None, gpt_args: dict[str, Any] | None = None,
                   pp_rank: int | None = None) -> Callable[..., Any]:
    """A Megatron-LM style provider of the family's model chunks (GPTModel on the local spec by
    default; `vocab_size` padded); `core_attention`: another attention core class (it holds no
    parameters, so the weights map the same), e.g. Transformer Engine's for packed `thd` batches,
    which the local one refuses; `gpt_args`: model keywords that replace the RoPE / length ones
    read from `arch` (another converter's mapping); `pp_rank`: the pipeline stage whose layers a
    block spec lists (a teacher's own layout: its pg_collection's; default parallel_state's)."""
    family = arch.family
    model_class = family.model_class(arch)
    core_attention = core_attention or family.core_attention(arch)
    uniform = not arch.dense_layers and family.stage_spec is None  # one layer spec for every layer
    spec = _with_core_attention(family.layer_spec(arch), core_attention) if uniform else None

    def stage(vp_stage: int | None) -> Any:
        if family.stage_spec is not None:
            return _with_core_attention(family.stage_spec(arch, config, vp_stage, pp_rank), core_attention)
        return _mixed_block_spec(config, core_attention, vp_stage, pp_rank)

    def provider(pre_process: bool = True, post_process: bool = True, vp_stage: int | None = None) -> Any:
        extra: dict[str, Any] = {**family.model_args(arch), **(gpt_args or {})}
        if vp_stage is not None:
            extra["vp_stage"] = vp_stage
        return model_class(
            config=config,
            transformer_layer_spec=spec if spec is not None else stage(vp_stage),
            vocab_size=vocab_size,
            pre_process=pre_process,
            post_process=post_process,
            share_embeddings_and_output_weights=arch.tied,
            **extra,
        )

    provider.__name__ = f"hf_{arch.model_type}"
    return provider


def _with_core_attention(spec: Any, core_attention: type | None) -> Any:
    """`spec` (a layer's, or a block's layers') with `core_attention` as the attention core."""
    if core_attention is not None:
        for layer in getattr(spec, "layer_specs", None) or [spec]:
            attention = layer.submodules.self_attention
            if hasattr(getattr(attention, "submodules", None), "core_attention"):  # not linear attention
                attention.submodules.core_attention = core_attention
    return spec


def _mixed_block_spec(config: Any, core_attention: type | None, vp_stage: int | None, pp_rank: int | None) -> Any:
    """This pipeline stage's layers of a model whose first layers are dense and the others mixtures
    of experts (config.moe_layer_freq), on the local spec."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm",
                                       **stage_args(vp_stage, pp_rank))
    return _with_core_attention(block, core_attention)


def _check_yarn_served(arch: HFArchitecture) -> None:
    """YaRN needs GPTModel's `position_embedding_type="yarn"` and attention that applies its factor
    from the config: megatron-core 0.16 has both (0.13.1 builds no rotary embedding for it)."""
    from megatron.core import package_info
    from megatron.core.transformer import attention

    if not hasattr(attention, "_yarn_get_concentration_factor_from_config"):
        raise UnsupportedCheckpointError(
            f"{arch.source}: RoPE scaling 'yarn' needs megatron-core >= 0.16 (GPTModel's YaRN embedding and its "
            f"attention factor; checked on 0.16.1 and 0.19.2), this is megatron-core {package_info.__version__}"
        )
