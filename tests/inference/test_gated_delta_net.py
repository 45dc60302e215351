"""The CPU gated-delta-net layer against transformers' own Qwen3.5 linear-attention layer (float32,
every parameter random, A_log and dt_bias included) to 1e-5 of the output's scale, on a sequence longer than one chunk;
packed sequences (cu_seqlens) equal each sequence run alone; a wrong decay fails."""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.megatron]

HIDDEN, T = 32, 150  # T: two full chunks of 64 and a partial one
SHAPE = dict(linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
             linear_conv_kernel_dim=4)


def _pair(seed=0):
    """transformers' layer (random parameters) and the package's layer holding the same weights."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    from megatron_rl_patches.inference.gated_delta_net import GatedDeltaNetLayer
    from megatron_rl_patches.testing.megatron_cpu import tiny_gpt_config

    config = transformers.Qwen3_5TextConfig(hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=4,
                                            num_key_value_heads=2, head_dim=8, layer_types=["linear_attention"],
                                            **SHAPE)
    torch.manual_seed(seed)
    reference = Qwen3_5GatedDeltaNet(config, 0).float().eval()
    with torch.no_grad():
        for param in reference.parameters():
            param.copy_(torch.randn_like(param) * 0.2 + (1.0 if param.ndim == 1 else 0.0))
    megatron_config = tiny_gpt_config(num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, layernorm_epsilon=1e-6)
    layer = GatedDeltaNetLayer(megatron_config, 1, key_heads=2, value_heads=4, key_head_dim=8, value_head_dim=8,
                               conv_kernel=4)
    with torch.no_grad():
        r = reference
        layer.in_proj.weight.copy_(torch.cat([r.in_proj_qkv.weight, r.in_proj_z.weight, r.in_proj_b.weight,
                                              r.in_proj_a.weight]))
        layer.conv1d.weight.copy_(r.conv1d.weight)
        layer.A_log.copy_(r.A_log)
        layer.dt_bias.copy_(r.dt_bias)
        layer.out_norm.weight.copy_(r.norm.weight)
        layer.out_proj.weight.copy_(r.out_proj.weight)
    return reference, layer


def test_layer_equals_transformers(megatron_cpu):
    reference, layer = _pair()
    x = torch.randn(2, T, HIDDEN)
    with torch.no_grad():
        want = reference(x)
        got, bias = layer(x.transpose(0, 1).contiguous(), None)
    assert bias is None
    scale = want.abs().max().item()  # outputs of up to ~5: float32 rounding of the two chunked orders
    assert (got.transpose(0, 1) - want).abs().max().item() < 1e-5 * scale
    with torch.no_grad():  # the negative control: a decay off by 10% is seen
        layer.A_log.add_(0.1)
        wrong, _ = layer(x.transpose(0, 1).contiguous(), None)
    assert (wrong.transpose(0, 1) - want).abs().max().item() > 1e-3


def test_packed_sequences_equal_each_alone(megatron_cpu):
    from megatron.core.packed_seq_params import PackedSeqParams

    _, layer = _pair(seed=1)
    first, second = torch.randn(70, 1, HIDDEN), torch.randn(90, 1, HIDDEN)
    cu = torch.tensor([0, 70, 160], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=90, max_seqlen_kv=90)
    with torch.no_grad():
        packed, _ = layer(torch.cat([first, second]), None, packed_seq_params=params)
        alone = torch.cat([layer(first, None)[0], layer(second, None)[0]])
        unpacked, _ = layer(torch.cat([first, second]), None)
    assert (packed - alone).abs().max().item() < 1e-6
    assert (unpacked[70:] - alone[70:]).abs().max().item() > 1e-3  # the second sequence sees the first otherwise


def test_a_context_parallel_row_layout_it_does_not_know_is_refused_by_name(megatron_cpu):
    """Sequence and context parallelism are served (tests/inference/gated_delta_net_ranks.py, in
    the HF 2-rank world); a row layout other than zigzag / contiguous is named before any weight."""
    from megatron_rl_patches.inference.gated_delta_net import GatedDeltaNetLayer
    from megatron_rl_patches.testing.megatron_cpu import tiny_gpt_config

    shape = dict(key_heads=2, value_heads=4, key_head_dim=8, value_head_dim=8, conv_kernel=4)
    served = GatedDeltaNetLayer(tiny_gpt_config(), 1, cp_layout="contiguous", **shape)  # the control
    assert served.cp_size == 1 and served.cp_group is None
    with pytest.raises(ValueError, match="layout must be one of"):
        GatedDeltaNetLayer(tiny_gpt_config(), 1, cp_layout="ring", **shape)


def test_the_tensor_parallel_group_is_the_models_own_where_given():
    """The layer's heads split over its pg_collection's tensor-parallel group (a teacher's own
    layout), over parallel_state's where it has none (as before: the linears get no group)."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from megatron_rl_patches.inference.gated_delta_net import tensor_parallel_of
    from megatron_rl_patches.testing.megatron_cpu import megatron_on_cpu

    with megatron_on_cpu():
        assert tensor_parallel_of(None) == (1, {})
        assert tensor_parallel_of(SimpleNamespace(cp=dist.group.WORLD)) == (1, {})  # a collection without tp
        one = dist.new_group([dist.get_rank()])
        assert tensor_parallel_of(SimpleNamespace(tp=one)) == (1, {"tp_group": one})


def test_the_row_layout_is_set_on_every_layer_of_a_model(megatron_cpu):
    from megatron_rl_patches.inference.gated_delta_net import GatedDeltaNetLayer, use_context_parallel_rows
    from megatron_rl_patches.testing.megatron_cpu import tiny_gpt_config

    shape = dict(key_heads=2, value_heads=4, key_head_dim=8, value_head_dim=8, conv_kernel=4)
    model = torch.nn.Sequential(GatedDeltaNetLayer(tiny_gpt_config(), 1, **shape), torch.nn.Linear(2, 2),
                                GatedDeltaNetLayer(tiny_gpt_config(), 2, **shape))
    with pytest.raises(ValueError, match="layout must be one of"):
        use_context_parallel_rows([model], "ring")
    assert {layer.cp_layout for layer in (model[0], model[2])} == {"zigzag"}  # nothing changed
    assert use_context_parallel_rows([model], "contiguous") == 2
    assert {layer.cp_layout for layer in (model[0], model[2])} == {"contiguous"}
