"""The gated-delta-net layer over 2 gloo ranks, run inside test_hf_multirank's world (no world of
its own): at context-parallel size 2 (zigzag and contiguous rows, unpacked and packed, heads split
over the ranks or, where 2 does not divide the key heads, every head on each) and with sequence
parallelism at TP=2, each against the same layer over whole sequences on one rank."""
from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist

T, HIDDEN = 152, 32  # T: two full chunks of 64 and a partial one; a multiple of 2 x cp


def _layer(config, key_heads: int, value_heads: int, **options):
    """A layer with every parameter random, the same on each rank (seeded)."""
    from megatron_rl_patches.inference.gated_delta_net import GatedDeltaNetLayer

    layer = GatedDeltaNetLayer(config, 1, key_heads=key_heads, value_heads=value_heads, key_head_dim=8,
                               value_head_dim=8, conv_kernel=4, **options)
    torch.manual_seed(3)
    with torch.no_grad():
        for param in layer.parameters():
            param.copy_(torch.randn_like(param) * 0.2 + (1.0 if param.ndim == 1 else 0.0))
    return layer


def context_parallel_errors() -> dict[str, float]:
    """In a world of context-parallel size 2 (TP=1): max |layer at CP=2 - the layer on whole
    sequences| over this rank's rows, per heads x row layout x format; "no exchange" is the
    negative control (the rank's rows run as if they were whole sequences)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_rl_patches.ops.context_rows import local_rows
    from megatron_rl_patches.testing.megatron_cpu import tiny_gpt_config

    rank = dist.get_rank()
    singles = [dist.new_group([r]) for r in range(dist.get_world_size())]  # every rank makes every group
    alone = SimpleNamespace(cp=singles[rank])  # the reference: context-parallel size 1
    config = tiny_gpt_config(num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, layernorm_epsilon=1e-6)
    torch.manual_seed(1)
    unpacked, packed = torch.randn(T, 2, HIDDEN), torch.randn(T, 1, HIDDEN)
    cu = torch.tensor([0, 64, T], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=88, max_seqlen_kv=88)
    errors: dict[str, float] = {}
    for heads in ((2, 4), (1, 2)):  # 2 key heads: split over the ranks; 1: every head on each rank
        whole = _layer(config, *heads, pg_collection=alone)
        for layout in ("zigzag", "contiguous"):
            layer = _layer(config, *heads, cp_layout=layout)  # parallel_state's context-parallel group
            for name, x, pack in (("bshd", unpacked, None), ("thd", packed, params)):
                where = {"length": T} if pack is None else {"cu_seqlens": cu}
                rows = local_rows(layout, rank, 2, **where)
                with torch.no_grad():
                    want = whole(x, None, packed_seq_params=pack)[0].index_select(0, rows)
                    got = layer(x.index_select(0, rows), None, packed_seq_params=pack)[0]
                errors[f"{heads[0]}kh-{layout}-{name}"] = (got - want).abs().max().item()
                if heads == (2, 4) and layout == "zigzag" and pack is None:
                    with torch.no_grad():
                        rows_alone = whole(x.index_select(0, rows), None)[0]
                    errors["no exchange"] = (rows_alone - want).abs().max().item()
    return errors


def sequence_parallel_error() -> float:
    """In a world of tensor-parallel size 2: max |the layer with sequence_parallel=True (the input
    cut over the sequence, the output reduce-scattered) - the same weights without it|."""
    from megatron.core import parallel_state as ps

    from megatron_rl_patches.testing.megatron_cpu import tiny_gpt_config

    shape = dict(num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, layernorm_epsilon=1e-6,
                 tensor_model_parallel_size=2)
    plain = _layer(tiny_gpt_config(**shape), 2, 4)
    split = _layer(tiny_gpt_config(**shape, sequence_parallel=True), 2, 4)
    split.load_state_dict(plain.state_dict())
    torch.manual_seed(2)
    x = torch.randn(T, 2, HIDDEN)
    rank = ps.get_tensor_model_parallel_rank()
    with torch.no_grad():
        want = plain(x, None)[0].chunk(2)[rank]
        got = split(x.chunk(2)[rank].contiguous(), None)[0]
    assert got.shape == want.shape, (got.shape, want.shape)
    return (got - want).abs().max().item()
