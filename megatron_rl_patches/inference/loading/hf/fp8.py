"""FP8 checkpoints (DeepSeek-V3's, Kimi-K2's): `float8_e4m3fn` weights, each with a
`weight_scale_inv` of one float per block (128 x 128 in config.json's `quantization_config`),
dequantized at load into the build's dtype one tensor at a time. Other quantized formats
(compressed-tensors, AWQ, GPTQ...) are refused by name before anything is read."""
from __future__ import annotations

from math import prod
from typing import Any

from megatron_rl_patches.inference.loading.hf.architecture import UnsupportedCheckpointError
from megatron_rl_patches.inference.loading.hf.checkpoint_config import read_checkpoint_config
from megatron_rl_patches.inference.loading.hf.families import architecture
from megatron_rl_patches.inference.loading.hf.names import checkpoint_tensors

SCALE = "_scale_inv"  # "X.weight" is scaled by "X.weight_scale_inv"


def fp8_block(config: dict[str, Any], source: str = "config.json") -> tuple[int, int] | None:
    """The (rows, columns) of a scale block of an FP8 checkpoint, None for an unquantized one;
    UnsupportedCheckpointError naming any other quantization method."""
    quant = config.get("quantization_config")
    if not quant:
        return None
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    block = quant.get("weight_block_size") if isinstance(quant, dict) else None
    if method != "fp8" or quant.get("fmt", "e4m3") != "e4m3" or not (
            isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise UnsupportedCheckpointError(
            f"{source}: quantization_config with quant_method={method!r} (weight_block_size {block!r}) "
            "is not served: the converter dequantizes block-scaled FP8 "
            "(quant_method 'fp8', fmt 'e4m3', weight_block_size [rows, columns]) only; use a bf16 checkpoint"
        )
    return block[0], block[1]


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    """One scale per block of a 2-D weight (the last blocks may be partial)."""
    return -(-shape[0] // block[0]), -(-shape[1] // block[1])


def dequantize(weight: Any, scale_inv: Any, block: tuple[int, int], dtype: Any) -> Any:
    """weight (float8) x its block's scale, in float32, then cast to `dtype`."""
    rows, cols = weight.shape
    scale = scale_inv.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return (weight.float() * scale).to(dtype)


def fp8_disk_bytes(path: Any) -> int | None:
    """The bytes an FP8 checkpoint's weights take on disk (None: not FP8), in DeepSeek-V3's layout:
    the layers' 2-D weights in float8 with a float32 scale per block, the router, the norms and
    the embedding / output tables in bf16; MTP layers apart. From config.json alone."""
    config = read_checkpoint_config(path).fields
    block = fp8_block(config, str(path))
    if block is None:
        return None
    total = 0
    for name, shape in checkpoint_tensors(architecture(config, str(path))).items():
        if name.startswith("model.layers.") and len(shape) == 2 and not name.endswith("mlp.gate.weight"):
            total += prod(shape) + 4 * prod(scale_shape(shape, block))
        else:
            total += 2 * prod(shape)
    return total
