"""What of megatron-core's DSA (DeepSeek sparse attention) a shared-prefix plan cannot run, by name:
read by MLA's rotary seam (`mla`) and by the DSA core (`sparse_attention`), which says why."""
# lazy imports: optional dependency megatron-core
from __future__ import annotations

import functools
import re
from typing import Any

import torch


@functools.cache
def megatron_core_before_0_19() -> str | None:
    """megatron-core's version where it is older than 0.19 (its DSAttention refuses packed input), else None."""
    from megatron.core.package_info import __version__  # lazy: optional dependency megatron-core

    found = re.match(r"(\d+)\.(\d+)", str(__version__))
    return str(__version__) if found and (int(found[1]), int(found[2])) < (0, 19) else None


def refusal(config: Any, training: bool) -> str | None:
    """What of this DSA config a plan cannot run (`training`: with gradients), or None."""
    if getattr(config, "experimental_attention_variant", None) != "dsa":
        return None
    if megatron_core_before_0_19():
        return (f"DSA sparse attention on megatron-core {megatron_core_before_0_19()} (its DSAttention refuses packed "
                "input)")
    if int(getattr(config, "context_parallel_size", 1) or 1) > 1:
        return "DSA sparse attention at context parallelism (not cut by the plan's share)"
    if (getattr(config, "dsa_kernel_backend", "none") or "none") != "none":
        return f"DSA's fused kernels (dsa_kernel_backend={config.dsa_kernel_backend!r})"
    if int(getattr(config, "dsa_indexer_topk_freq", 1) or 1) != 1:
        return "DSA's top-k shared across layers (dsa_indexer_topk_freq > 1)"
    if getattr(config, "dsa_indexer_rope_interleaved", False):
        return "DSA's indexer with interleaved RoPE (dsa_indexer_rope_interleaved)"
    if getattr(config, "params_dtype", None) == torch.float64:
        return ("DSA sparse attention in float64 (megatron-core's masked DSA path adds a float32 mask to the indexer's "
                "float64 scores, and asserts they match)")
    if training and float(getattr(config, "dsa_indexer_loss_coeff", 0.0) or 0.0) > 0:
        return ("DSA's indexer loss in training (dsa_indexer_loss_coeff > 0: averaged over the stream's rows, a shared "
                "row would count once instead of once per sample)")
    return None
