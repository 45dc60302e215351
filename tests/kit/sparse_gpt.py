"""A tiny megatron-core GPTModel with DeepSeek sparse attention (DSA: megatron-core 0.19's
`AbsorbedMLASelfAttention` around its `DSAttention` core and `DSAIndexer`, GLM-5's and
DeepSeek-V3.2's layer) on CPU: megatron-core's own DSA spec with the local backend, its indexer's
duplicated projections a plain linear (megatron-core asks them of Transformer Engine's `TELinear`,
which CPU lacks), the MLA down-projections megatron-core's column-parallel linear (which its absorbed
MLA takes), and no Hadamard rotation (`dsa_indexer_rotate_activation=False`: its kernel is CUDA's
`fast_hadamard_transform`)."""
from __future__ import annotations

from typing import Any

import torch

from kit.latent_gpt import tiny_mla_config


def dsa_runs_on_cpu() -> bool:
    """Whether this megatron-core's DSA runs packed input on CPU: 0.19's does; 0.16's DSAttention refuses
    packed input and its indexer needs CUDA's Hadamard kernel in bf16."""
    from megatron.core.package_info import __version__

    return tuple(int(part) for part in __version__.split(".")[:2]) >= (0, 19)


def tiny_dsa_config(dtype: torch.dtype = torch.float32, topk: int = 4, relu: bool = False, **overrides: Any) -> Any:
    """A 2-layer MLA config with DSA: an indexer of 2 heads of width 8 keeping `topk` keys per query
    (fewer than most rows see), its ReLU scoring off unless `relu` (its zeros tie, and torch.topk breaks
    ties by the keys' places in the stream)."""
    values: dict[str, Any] = dict(experimental_attention_variant="dsa", dsa_indexer_n_heads=2, dsa_indexer_head_dim=8,
                                  dsa_indexer_topk=topk, dsa_indexer_rotate_activation=False,
                                  dsa_indexer_scoring_relu=relu, add_bias_linear=False)
    values.update(overrides)
    return tiny_mla_config("rope", dtype, **values)


class DuplicatedLinear(torch.nn.Linear):
    """The indexer's projections (megatron-core's `parallel_mode="duplicated"`: whole on every rank),
    returning (output, no bias) as megatron-core's linears do."""

    def __init__(self, input_size: int, output_size: int, *, config: Any, init_method: Any, bias: bool,
                 **unused: Any):
        super().__init__(input_size, output_size, bias=bias, dtype=config.params_dtype)
        init_method(self.weight)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return super().forward(x), None


def build_dsa_gpt(config: Any, seq_length: int = 512, seed: int = 3) -> Any:
    """A real GPTModel of `config` (a DSA config) with megatron-core's DSA layer spec."""
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import get_dsa_module_spec_for_backend
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    from megatron_rl_patches.inference.loading.hf.families.mla import disarm_mocked_te_in_mla
    from megatron_rl_patches.testing.megatron_cpu import TINY_VOCAB

    class Backend(LocalSpecProvider):
        def linear(self) -> type:
            return DuplicatedLinear

    disarm_mocked_te_in_mla()
    spec = get_gpt_layer_local_spec(multi_latent_attention=True, qk_layernorm=True, normalization="RMSNorm")
    attention = get_dsa_module_spec_for_backend(config, Backend())
    attention.submodules.linear_q_down_proj = ColumnParallelLinear
    attention.submodules.linear_kv_down_proj = ColumnParallelLinear
    spec.submodules.self_attention = attention
    torch.manual_seed(seed)
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=TINY_VOCAB, max_sequence_length=seq_length,
                     position_embedding_type="rope")
    return model.to(config.params_dtype)
