"""MiMo-7B (`model_type` mimo, remote code): Qwen2's layout (q/k/v biases, a SwiGLU MLP in every
layer) plus multi-token prediction layers under `model.mtp_layers.*`, which scoring does not use:
read as Qwen2, the MTP tensors skipped."""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from megatron_rl_patches.inference.loading.hf.architecture import HFArchitecture, decoder_architecture
from megatron_rl_patches.inference.loading.hf.families.common import dense_layer_params, dense_layer_tensors
from megatron_rl_patches.inference.loading.hf.families.family import Family
from megatron_rl_patches.inference.loading.hf.families.fields import SLIDING


def read(config: dict[str, Any], source: str) -> HFArchitecture:
    arch = decoder_architecture(config, source, qkv_bias=True, qk_norm=False, moe=False)
    return replace(arch, mtp_layers=int(config.get("num_nextn_predict_layers") or 0))


def mtp_tensors(arch: HFArchitecture) -> tuple[str, ...]:
    return ("model.mtp_layers.",)


FAMILY = Family(
    name="mimo", hf_class="Qwen2", read=read, layer_tensors=dense_layer_tensors, layer_params=dense_layer_params,
    skipped=mtp_tensors, tiny_fields={"head_dim": None, "num_nextn_predict_layers": 1},
    fields=SLIDING | {"num_nextn_predict_layers"},  # Qwen2's (remote code on transformers' Qwen2)
)
