"""FP8 checkpoints as DeepSeek-V3 and Kimi-K2 ship them: a random tiny deepseek_v3 quantized to
float8_e4m3fn per block (128 x 128 as published, and 16 x 16 for several and partial blocks per
weight), built by the package, equals transformers' float32 forward of the same weights dequantized
by hand; the unquantized weights differ (the negative control); other quantization formats, a
missing scale and a scale of the wrong shape are refused by name."""
from __future__ import annotations

import json

import pytest
import torch

from megatron_rl_patches import build_inference_model_from_hf
from megatron_rl_patches.inference.loading.errors import WeightsMismatchError
from megatron_rl_patches.inference.loading.hf import UnsupportedCheckpointError
from megatron_rl_patches.testing.hf_checkpoints import save_tiny_hf
from megatron_rl_patches.testing.megatron_cpu import make_batch

pytestmark = [pytest.mark.megatron, pytest.mark.usefixtures("transformers", "moe_router_on_cpu")]

VOCAB, SEQ, TOL = 1001, 12, 1e-4
FP8_MAX = 448.0  # the largest float8_e4m3fn


def _quantized(name: str, tensor: torch.Tensor) -> bool:
    """The tensors DeepSeek-V3 stores in FP8: the layers' linear weights, not norms or the router."""
    return name.startswith("model.layers.") and tensor.ndim == 2 and not name.endswith("mlp.gate.weight")


def _quantize(weight: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = -(-weight.shape[0] // block), -(-weight.shape[1] // block)
    q = torch.empty(weight.shape, dtype=torch.float8_e4m3fn)
    scale = torch.empty(rows, cols)
    for i in range(rows):
        for j in range(cols):
            part = weight[i * block:(i + 1) * block, j * block:(j + 1) * block]
            scale[i, j] = part.abs().max() / FP8_MAX
            q[i * block:(i + 1) * block, j * block:(j + 1) * block] = (part / scale[i, j]).to(torch.float8_e4m3fn)
    return q, scale


def _by_hand(q: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    out = torch.empty(q.shape)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            rows, cols = slice(i * block, (i + 1) * block), slice(j * block, (j + 1) * block)
            out[rows, cols] = q[rows, cols].float() * scale[i, j]
    return out


def _fp8_pair(tmp_path, block: int, seed: int = 3):
    """(directory of the FP8 checkpoint, directory of its weights dequantized by hand in float32,
    the transformers model of the original weights)."""
    from safetensors.torch import load_file, save_file

    original = save_tiny_hf(tmp_path / "original", "deepseek_v3", seed=seed)
    config = json.loads((tmp_path / "original" / "config.json").read_text())
    tensors = load_file(tmp_path / "original" / "model.safetensors")
    fp8, by_hand = {}, {}
    for name, tensor in tensors.items():
        if _quantized(name, tensor):
            q, scale = _quantize(tensor, block)
            fp8.update({name: q, name + "_scale_inv": scale})
            by_hand[name] = _by_hand(q, scale, block)
        else:
            fp8[name] = by_hand[name] = tensor
    quantization = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                    "weight_block_size": [block, block]}
    for directory, weights, extra in (("fp8", fp8, {"quantization_config": quantization}), ("by_hand", by_hand, {})):
        (tmp_path / directory).mkdir()
        (tmp_path / directory / "config.json").write_text(json.dumps({**config, **extra}))
        save_file(weights, str(tmp_path / directory / "model.safetensors"), metadata={"format": "pt"})
    return tmp_path / "fp8", tmp_path / "by_hand", original


def _log_probs(chunk, batch) -> torch.Tensor:
    with torch.no_grad():
        logits = chunk(batch["tokens"], batch["position_ids"], batch["attention_mask"])
    return torch.log_softmax(logits.double()[..., :VOCAB], dim=-1)


def _reference(model, batch) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(batch["tokens"]).logits.double(), dim=-1)


@pytest.mark.parametrize("block", [128, 16])
def test_fp8_equals_the_weights_dequantized_by_hand(megatron_cpu, tmp_path, block):
    import transformers

    fp8, by_hand, original = _fp8_pair(tmp_path, block)
    batch = make_batch(batch_size=2, seq_length=SEQ, vocab_size=VOCAB, seed=0)
    want = _reference(transformers.DeepseekV3ForCausalLM.from_pretrained(by_hand, dtype=torch.float32).eval(), batch)
    got = _log_probs(build_inference_model_from_hf(fp8, dtype=torch.float32)[0], batch)
    assert (got - want).abs().max().item() < TOL
    assert (got - _reference(original, batch)).abs().max().item() > 10 * TOL  # FP8 rounding is there


@pytest.mark.parametrize("method", ["compressed-tensors", "awq", "gptq"])
def test_other_quantizations_refused_by_name(megatron_cpu, tmp_path, method):
    save_tiny_hf(tmp_path, "deepseek_v3", seed=3)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": method, "bits": 4}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedCheckpointError, match=f"quant_method='{method}'"):
        build_inference_model_from_hf(tmp_path, dtype=torch.float32)


def test_missing_or_misshaped_scales_refused(megatron_cpu, tmp_path):
    from safetensors.torch import load_file, save_file

    fp8, _, _ = _fp8_pair(tmp_path, 16)
    tensors = load_file(fp8 / "model.safetensors")
    name = "model.layers.0.self_attn.kv_b_proj.weight"
    tensors[name + "_scale_inv"] = torch.ones(1, 1)
    save_file(tensors, str(fp8 / "model.safetensors"))
    with pytest.raises(WeightsMismatchError, match=r"kv_b_proj.weight_scale_inv \(checkpoint \(1, 1\), one per"):
        build_inference_model_from_hf(fp8, dtype=torch.float32)
    del tensors[name + "_scale_inv"]
    save_file(tensors, str(fp8 / "model.safetensors"))
    with pytest.raises(WeightsMismatchError, match=r"kv_b_proj.weight \(float8 without"):
        build_inference_model_from_hf(fp8, dtype=torch.float32)
