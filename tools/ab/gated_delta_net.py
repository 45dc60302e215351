"""For `../shared/tools/ab-bench REV_A REV_B -- python tools/ab/gated_delta_net.py`: the package's CPU
gated-delta-net layer (Qwen3.5's / Qwen3-Next's linear attention) at context-parallel size 1, the
forward of a teacher's layer: the best of 20 calls after 3 warm-up calls, CPU, 1 thread, fp32, no
gradient; unpacked [b=2, T=512] and packed (3 sequences, 1024 rows); hidden 256, 4 key and 8 value
heads of 64. Prints one JSON line (milliseconds) and, on stderr, a checksum of the outputs (the
same on both revisions when the arithmetic is)."""
from __future__ import annotations

import json
import sys
import time

import torch

from megatron_rl_patches.testing.megatron_cpu import megatron_on_cpu, tiny_gpt_config

torch.set_num_threads(1)


def best_ms(fn, calls: int = 20, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


with megatron_on_cpu():
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_rl_patches.inference.gated_delta_net import GatedDeltaNetLayer

    HIDDEN = 256
    layer = GatedDeltaNetLayer(tiny_gpt_config(num_layers=1, hidden_size=HIDDEN, num_attention_heads=4,
                                               layernorm_epsilon=1e-6), 1, key_heads=4, value_heads=8,
                               key_head_dim=64, value_head_dim=64, conv_kernel=4)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in layer.parameters():
            param.copy_(torch.randn(param.shape, generator=g) * 0.05 + (1.0 if param.ndim == 1 else 0.0))
    unpacked = torch.randn(512, 2, HIDDEN, generator=g)
    packed = torch.randn(1024, 1, HIDDEN, generator=g)
    cu = torch.tensor([0, 300, 700, 1024], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=400,
                             max_seqlen_kv=400)
    with torch.no_grad():
        row = {"unpacked_ms": best_ms(lambda: layer(unpacked, None)),
               "packed_ms": best_ms(lambda: layer(packed, None, packed_seq_params=params))}
        checksum = float(layer(unpacked, None)[0].double().sum()) + float(
            layer(packed, None, packed_seq_params=params)[0].double().sum())
print(f"checksum {checksum!r}", file=sys.stderr)
print(json.dumps(row))
