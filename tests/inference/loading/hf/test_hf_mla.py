"""Multi-latent attention teachers (deepseek_v3: DeepSeek-V3, Moonlight, Kimi-K2) against
transformers' own float32 forward, every parameter random (router biases too), a dense layer then a
mixture of experts (or dense only): both `rope_interleave` settings, queries
without a low-rank step (Moonlight), YaRN with mscale / mscale_all_dim; negative controls (the
rotary rows read the other way, YaRN's mscale dropped) fail; MTP layers stored after the last one
are left out; swap/stream equal resident bit for bit (deepseek_v3 and glm4_moe_lite); what
megatron-core cannot build is refused."""
from __future__ import annotations

import json

import pytest
import torch

from megatron_rl_patches import build_inference_model_from_hf
from megatron_rl_patches.inference.loading.hf import UnsupportedCheckpointError
from megatron_rl_patches.inference.loading.hf.families import architecture
from megatron_rl_patches.testing.hf_checkpoints import save_tiny_hf, tiny_hf_config, write_safetensors
from megatron_rl_patches.testing.megatron_cpu import make_batch

pytestmark = [pytest.mark.megatron, pytest.mark.usefixtures("transformers", "moe_router_on_cpu")]

VOCAB, SEQ, TOL = 1001, 12, 1e-4
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "mscale": 0.9, "mscale_all_dim": 0.7, "beta_fast": 32.0, "beta_slow": 1.0}
CASES = {
    "interleaved": {},  # the tiny kit's: layer 0 dense, layer 1 MoE (sigmoid router, groups, shared expert)
    "dense": {"first_k_dense_replace": 2},
    "rotate_half": {"rope_interleave": False},
    "no_q_lora": {"q_lora_rank": None},
    "yarn_mscale": {"rope_parameters": YARN},
    "yarn_rotate_half": {"rope_parameters": YARN, "rope_interleave": False},
}


def _batch(seed=0):
    return make_batch(batch_size=2, seq_length=SEQ, vocab_size=VOCAB, seed=seed)


def _reference(model, batch) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(batch["tokens"]).logits.double(), dim=-1)


def _log_probs(chunk, batch) -> torch.Tensor:
    with torch.no_grad():
        logits = chunk(batch["tokens"], batch["position_ids"], batch["attention_mask"])
    return torch.log_softmax(logits.double()[..., :VOCAB], dim=-1)


def _release():
    from megatron.core.package_info import __version__

    return tuple(int(p) for p in __version__.split(".")[:2])


def _yarn_needs_016(overrides):
    if "rope_parameters" in overrides and _release() < (0, 16):
        pytest.skip("YaRN with MLA is refused before megatron-core 0.16 (test_refused_by_megatron_core_version)")
    if "q_lora_rank" in overrides and _release() >= (0, 19):
        pytest.skip("q_lora_rank null is refused on megatron-core 0.19 (test_refused_by_megatron_core_version)")


def _rewrite_config(root, **changes):
    config = json.loads((root / "config.json").read_text())
    config.update(changes)
    (root / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("case", list(CASES))
def test_log_probs_equal_transformers(megatron_cpu, tmp_path, case):
    _yarn_needs_016(CASES[case])
    model = save_tiny_hf(tmp_path, "deepseek_v3", seed=3, **CASES[case])
    batch = _batch()
    got = _log_probs(build_inference_model_from_hf(tmp_path, dtype=torch.float32)[0], batch)
    assert (got - _reference(model, batch)).abs().max().item() < TOL


@pytest.mark.parametrize("case", ["interleaved", "rotate_half"])
def test_rotary_rows_read_the_other_way_fail(megatron_cpu, tmp_path, case):
    """The negative control of the reordering: config.json claiming the other layout must not pass."""
    model = save_tiny_hf(tmp_path, "deepseek_v3", seed=3, **CASES[case])
    _rewrite_config(tmp_path, rope_interleave=case == "rotate_half")
    batch = _batch()
    got = _log_probs(build_inference_model_from_hf(tmp_path, dtype=torch.float32)[0], batch)
    assert (got - _reference(model, batch)).abs().max().item() > 1e-2


def test_yarn_without_its_mscale_fails(megatron_cpu, tmp_path):
    _yarn_needs_016(CASES["yarn_mscale"])
    model = save_tiny_hf(tmp_path, "deepseek_v3", seed=3, rope_parameters=YARN)
    _rewrite_config(tmp_path, rope_parameters={k: v for k, v in YARN.items() if not k.startswith("mscale")})
    batch = _batch()
    got = _log_probs(build_inference_model_from_hf(tmp_path, dtype=torch.float32)[0], batch)
    assert (got - _reference(model, batch)).abs().max().item() > 1e-3


@pytest.mark.parametrize(("overrides", "refused", "message"), [
    ({"rope_parameters": YARN}, lambda release: release < (0, 16), "YaRN with multi-latent attention on"),
    ({"q_lora_rank": None}, lambda release: release >= (0, 19), "q_lora_rank=null .* on megatron-core"),
], ids=["yarn", "no_q_lora"])
def test_refused_by_megatron_core_version(megatron_cpu, tmp_path, overrides, refused, message):
    if not refused(_release()):
        pytest.skip(f"megatron-core {_release()} builds it (test_log_probs_equal_transformers)")
    save_tiny_hf(tmp_path, "deepseek_v3", seed=3, **overrides)
    with pytest.raises(UnsupportedCheckpointError, match=message):
        build_inference_model_from_hf(tmp_path, dtype=torch.float32)


def test_kimi_k2_and_mtp_layers(megatron_cpu, tmp_path):
    """Kimi-K2's model_type reads as deepseek_v3; a stored MTP layer (model.layers.N.*) is left out when
    num_nextn_predict_layers names it and refused as unexpected otherwise."""
    model = save_tiny_hf(tmp_path, "deepseek_v3", seed=3)
    from megatron_rl_patches.inference.loading.hf.files import read_tensor, tensor_index

    tensors = {name: read_tensor(entry) for name, entry in tensor_index(tmp_path).items()}
    tensors.update({name.replace("model.layers.1.", "model.layers.2."): value * 7.0
                    for name, value in list(tensors.items()) if name.startswith("model.layers.1.")})
    tensors["model.layers.2.eh_proj.weight"] = torch.randn(32, 64)  # an MTP layer's own projection
    (tmp_path / "model.safetensors").unlink()
    write_safetensors(tmp_path / "model.safetensors", tensors)
    from megatron_rl_patches.inference.loading.errors import WeightsMismatchError

    _rewrite_config(tmp_path, num_nextn_predict_layers=0)
    with pytest.raises(WeightsMismatchError, match=r"\d+ unexpected: model\.layers\.2\."):
        build_inference_model_from_hf(tmp_path, dtype=torch.float32)
    _rewrite_config(tmp_path, model_type="kimi_k2", num_nextn_predict_layers=1)
    batch = _batch()
    got = _log_probs(build_inference_model_from_hf(tmp_path, dtype=torch.float32)[0], batch)
    assert (got - _reference(model, batch)).abs().max().item() < TOL


@pytest.mark.parametrize("kind", ["deepseek_v3", "glm4_moe_lite"])
def test_swap_and_stream_equal_resident_bit_for_bit(megatron_cpu, tmp_path, kind):
    save_tiny_hf(tmp_path, kind, seed=4, rope_interleave=False)
    batch = _batch(seed=1)
    want = _log_probs(build_inference_model_from_hf(tmp_path, dtype=torch.float32)[0], batch)
    assert want.isfinite().all() and want.std() > 0.1  # a real distribution, not a constant
    for residency in ("swap", "stream"):
        got = _log_probs(build_inference_model_from_hf(tmp_path, residency=residency, dtype=torch.float32)[0], batch)
        assert torch.equal(got, want), residency


@pytest.mark.parametrize(("changes", "message"), [
    ({"attention_bias": True}, "attention_bias=true with multi-latent attention"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}},
     "RoPE scaling 'linear' .*with multi-latent attention"),
    ({"rope_interleave": "yes"}, "rope_interleave must be true or false"),
])
def test_what_mla_cannot_build_is_refused(changes, message):
    with pytest.raises(ValueError, match=message):
        architecture(tiny_hf_config("deepseek_v3", **changes))


@pytest.mark.parametrize("layer_types", [None, ["dense", "dense"], ["dense", "sparse"]])
def test_glm4_moe_lite_equals_transformers(megatron_cpu, tmp_path, layer_types):
    """GLM-4.7-Flash: DeepSeek-V3's layer, dense vs sparse from mlp_layer_types (default: the first dense)."""
    model = save_tiny_hf(tmp_path, "glm4_moe_lite", seed=5, rope_interleave=False, mlp_layer_types=layer_types)
    batch = _batch()
    got = _log_probs(build_inference_model_from_hf(tmp_path, dtype=torch.float32)[0], batch)
    assert (got - _reference(model, batch)).abs().max().item() < TOL


@pytest.mark.parametrize(("changes", "message"), [
    ({"mlp_layer_types": ["sparse", "dense"]}, "the dense ones first"),
    ({"first_k_dense_replace": 2}, "first_k_dense_replace=2 without mlp_layer_types"),
])
def test_glm4_moe_lite_layer_types_refused(changes, message):
    with pytest.raises(UnsupportedCheckpointError, match=message):
        architecture(tiny_hf_config("glm4_moe_lite", **{"mlp_layer_types": None, **changes}))
