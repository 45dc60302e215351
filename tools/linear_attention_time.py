"""CPU time of one gated-delta-net linear-attention layer (the package's torch path) against one
gated full-attention layer of the same width (megatron-core's local SelfAttention with the output
gate, per-head q/k norms and its DotProductAttention) at T tokens, forward only, float32, one
thread: the figure issue 46's note asks for. Run from the repository root:
    PYTHONPATH=$PWD python tools/linear_attention_time.py [--tokens 4096] [--repeats 3]"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

HIDDEN, HEADS, HEAD_DIM, KV_HEADS = 1024, 8, 128, 2  # the linear layer: 8 key and 8 value heads of 128 too


def _seconds(run, repeats: int) -> float:
    run()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module

    from megatron_rl_patches.inference.gated_delta_net import GatedDeltaNetLayer
    from megatron_rl_patches.testing.megatron_cpu import megatron_on_cpu, tiny_gpt_config

    with megatron_on_cpu(), torch.no_grad():
        config = tiny_gpt_config(num_layers=1, hidden_size=HIDDEN, num_attention_heads=HEADS, kv_channels=HEAD_DIM,
                                 num_query_groups=KV_HEADS, qk_layernorm=True, attention_output_gate=True,
                                 normalization="RMSNorm", layernorm_epsilon=1e-6, add_bias_linear=False)
        full = build_module(get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm").submodules
                            .self_attention, config=config, layer_number=1).eval()
        linear = GatedDeltaNetLayer(config, 1, key_heads=HEADS, value_heads=HEADS, key_head_dim=HEAD_DIM,
                                    value_head_dim=HEAD_DIM, conv_kernel=4).eval()
        for module in (full, linear):
            for param in module.parameters():
                param.normal_(0.0, 0.02)
        x = torch.randn(args.tokens, 1, HIDDEN)
        mask = torch.ones(args.tokens, args.tokens, dtype=torch.bool).triu(1)[None, None]
        full_s = _seconds(lambda: full(x, mask), args.repeats)
        linear_s = _seconds(lambda: linear(x, None), args.repeats)
    print(f"T={args.tokens}, hidden {HIDDEN}, {HEADS} heads of {HEAD_DIM}, 1 thread, float32, forward:")
    print(f"  full attention (gated, local DotProductAttention): {full_s:.3f} s")
    print(f"  linear attention (gated delta net, torch path):     {linear_s:.3f} s ({linear_s / full_s:.2f}x)")


if __name__ == "__main__":
    main()
