"""A tiny GPTModel whose layers are megatron-core's own `GatedDeltaNet` (3 of every 4, the rest
self-attention, as Qwen3.5 and Qwen3-Next mix them) on CPU. megatron-core builds the layer only
where flash-linear-attention is installed (GPU only) and reads fla's `l2norm` in its forward;
`gated_delta_net_on_cpu()` lets it build and gives it the same normalization in torch
(`inference.gated_delta_rule.l2_normalized`); with `deterministic_mode` the recurrence is
megatron-core's own torch path (`torch_chunk_gated_delta_rule`). The spec is the experimental
variant's (which only builds Transformer Engine modules) with local ones: the input norm a module
of its own, not fused into `in_proj`. `sequential_gated_delta_rule` is the recurrence token by
token in the input's dtype: a float64 stand-in for the chunked rule (same signature)."""
# lazy imports: optional dependency megatron-core
from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

from megatron_rl_patches.inference.gated_delta_rule import l2_normalized
from megatron_rl_patches.testing.megatron_cpu import TINY_VOCAB, tiny_gpt_config
from megatron_rl_patches.testing.packed_gpt import packed_attention_class


def megatron_gated_delta_net_served() -> bool:
    """Whether this megatron-core's GatedDeltaNet is the one the plan's route serves (0.16's
    `megatron.core.ssm.gated_delta_net`, with its torch rule; 0.19 moved and rewrote it)."""
    name = "megatron.core.ssm.gated_delta_net"
    try:
        module = importlib.import_module(name)
    except ImportError:
        return False
    net = getattr(module, "GatedDeltaNet", None)
    return hasattr(module, "torch_chunk_gated_delta_rule") and getattr(net, "__module__", None) == name


@contextlib.contextmanager
def gated_delta_net_on_cpu(rule: Any = None) -> Iterator[None]:
    """megatron-core's GatedDeltaNet buildable and runnable on CPU while inside (torch.compile off:
    its gated norm is compiled otherwise); `rule`: a stand-in for `torch_chunk_gated_delta_rule`."""
    from megatron.core.ssm import gated_delta_net as module

    replaced = {"HAVE_FLA": True, "l2norm": l2_normalized}
    if rule is not None:
        replaced["torch_chunk_gated_delta_rule"] = rule
    saved = {name: getattr(module, name, None) for name in replaced}
    for name, value in replaced.items():
        setattr(module, name, value)
    try:
        with torch._dynamo.config.patch(disable=True):
            yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


def tiny_gated_delta_net_config(**overrides: Any) -> Any:
    """4 layers (gated delta nets at 1-3, self-attention at 4), 2 key heads and 4 value heads of 8,
    a convolution of 4 taps, SwiGLU and RMSNorm, deterministic mode (megatron-core's torch rule)."""
    values: dict[str, Any] = dict(
        num_layers=4, experimental_attention_variant="gated_delta_net", linear_attention_freq=4,
        linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
        linear_num_value_heads=4, deterministic_mode=True, normalization="RMSNorm", activation_func=F.silu,
        gated_linear_unit=True, num_query_groups=2)
    values.update(overrides)
    return tiny_gpt_config(**values)


def gated_delta_net_block_spec(config: Any) -> Any:
    """The layers of `config`'s linear-attention pattern, megatron-core's local modules."""
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import get_linear_attention_pattern
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    attention_layer = get_gpt_layer_local_spec(normalization=config.normalization)
    attention_layer.submodules.self_attention.submodules.core_attention = packed_attention_class()
    local = attention_layer.submodules
    linear = ModuleSpec(module=GatedDeltaNet, submodules=GatedDeltaNetSubmodules(
        in_proj=ColumnParallelLinear, out_norm=local.input_layernorm, out_proj=RowParallelLinear))
    linear_layer = ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=local.input_layernorm, self_attention=linear, self_attn_bda=local.self_attn_bda,
        pre_mlp_layernorm=local.pre_mlp_layernorm, mlp=local.mlp, mlp_bda=local.mlp_bda))
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    pattern = get_linear_attention_pattern(config)
    first = get_transformer_layer_offset(config)  # this pipeline stage's layers
    stage = pattern[first:first + get_num_layers_to_build(config)]
    return TransformerBlockSubmodules(layer_specs=[linear_layer if kind else attention_layer for kind in stage],
                                      layer_norm=local.input_layernorm)


def build_gated_delta_net_gpt(config: Any = None, vocab_size: int = TINY_VOCAB, seq_length: int = 256,
                              seed: int = 0, pre_process: bool = True, post_process: bool = True) -> Any:
    """A real GPTModel (RoPE) of `config` (default `tiny_gated_delta_net_config()`), this pipeline
    stage's (`pre_process` / `post_process` as a model provider passes them); build it inside
    `gated_delta_net_on_cpu()`."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    config = tiny_gated_delta_net_config() if config is None else config
    torch.manual_seed(seed)
    model = GPTModel(config=config, transformer_layer_spec=gated_delta_net_block_spec(config), vocab_size=vocab_size,
                     max_sequence_length=seq_length, position_embedding_type="rope", pre_process=pre_process,
                     post_process=post_process)
    with torch.no_grad():  # a memory of tens of tokens (megatron-core's A in [1, 16] forgets within a few)
        for module in model.modules():
            if hasattr(module, "A_log") and hasattr(module, "conv1d"):
                module.A_log.copy_(torch.empty_like(module.A_log).uniform_(0.02, 0.2).log())
                module.dt_bias.copy_(torch.randn_like(module.dt_bias) * 0.5 - 1.0)
    return model


def sequential_gated_delta_rule(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
                                beta: torch.Tensor, chunk_size: int = 64, initial_state: Any = None,
                                output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False) -> Any:
    """The gated delta rule one token at a time, in the values' dtype: per head, S <- exp(g_t) S,
    u_t = beta_t (v_t - S^T k_t), S <- S + k_t u_t^T, o_t = S^T q_t / sqrt(dk). Inputs [b, t, h, d]
    (g, beta [b, t, h]); returns (o [b, t, h, dv], the final state [b, h, dk, dv] or None)."""
    dtype = value.dtype
    if use_qk_l2norm_in_kernel:
        query, key = l2_normalized(query), l2_normalized(key)
    q, k, v, g, beta = (x.to(dtype) for x in (query * query.shape[-1] ** -0.5, key, value, g, beta))
    b, t, h, dk = k.shape
    state = q.new_zeros(b, h, dk, v.shape[-1]) if initial_state is None else initial_state.to(dtype)
    out = []
    for i in range(t):
        state = state * g[:, i].exp()[..., None, None]
        read = (state * k[:, i, :, :, None]).sum(-2)
        update = beta[:, i, :, None] * (v[:, i] - read)
        state = state + k[:, i, :, :, None] * update[:, :, None, :]
        out.append((state * q[:, i, :, :, None]).sum(-2))
    return torch.stack(out, dim=1), state if output_final_state else None
