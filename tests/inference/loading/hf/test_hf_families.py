"""The families and RoPE types beyond plain Llama / Qwen against transformers' own float32 forward
(every parameter random, router biases too): log-probs within 1e-4 on sequences long enough that
the scaling matters (the same checkpoint built without it differs by more than 1e-3), and
residency swap / stream equal resident bit for bit."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from kit.hf_scores import built_log_probs, transformers_log_probs

from megatron_rl_patches import build_inference_model_from_hf
from megatron_rl_patches.inference.loading.hf import UnsupportedCheckpointError
from megatron_rl_patches.testing.hf_checkpoints import add_mtp_tensors, router_margin, save_tiny_hf, save_tiny_mimo
from megatron_rl_patches.testing.megatron_cpu import make_batch

pytestmark = [pytest.mark.megatron, pytest.mark.usefixtures("transformers", "moe_router_on_cpu")]

VOCAB, SEQ, TOL = 1001, 64, 1e-4
LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
ROPE_CASES = {
    # head_dim 16 at theta 5e5: two of its eight frequencies are ones llama3 rescales
    "llama3": ("llama", {"rope_parameters": LLAMA3, "hidden_size": 64, "head_dim": 16}),
    "linear": ("llama", {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}}),
    "yarn": ("qwen2", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                           "original_max_position_embeddings": 32}}),
}


@pytest.fixture
def fused_processors(clean_patch_state):
    import megatron_rl_patches

    megatron_rl_patches.apply(only="gpt_output_processor")


def _megatron_core_has_yarn() -> bool:
    from megatron.core.transformer import attention

    return hasattr(attention, "_yarn_get_concentration_factor_from_config")


def _has_shared_expert_gate() -> bool:
    from dataclasses import fields

    from megatron.core.transformer.transformer_config import TransformerConfig

    return "moe_shared_expert_gate" in {f.name for f in fields(TransformerConfig)}


@pytest.mark.parametrize("rope", sorted(ROPE_CASES))
def test_rope_scaling_equals_transformers(megatron_cpu, fused_processors, tmp_path, rope):
    kind, overrides = ROPE_CASES[rope]
    model = save_tiny_hf(tmp_path / "scaled", kind, seed=3, max_position_embeddings=128, **overrides)
    batch = make_batch(batch_size=2, seq_length=SEQ, vocab_size=VOCAB, seed=0)
    want = transformers_log_probs(model, batch)
    if rope == "yarn" and not _megatron_core_has_yarn():
        with pytest.raises(UnsupportedCheckpointError, match=r"'yarn' needs megatron-core >= 0.16"):
            build_inference_model_from_hf(tmp_path / "scaled", dtype=torch.float32)
        return
    got = built_log_probs(build_inference_model_from_hf(tmp_path / "scaled", dtype=torch.float32)[0], batch, VOCAB)
    assert (got - want).abs().max().item() < TOL
    # the negative control: the same weights with plain RoPE
    shutil.copytree(tmp_path / "scaled", tmp_path / "plain")
    config = json.loads((tmp_path / "plain" / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": config["rope_parameters"]["rope_theta"]}
    (tmp_path / "plain" / "config.json").write_text(json.dumps(config))
    plain = built_log_probs(build_inference_model_from_hf(tmp_path / "plain", dtype=torch.float32)[0], batch, VOCAB)
    assert (plain - want).abs().max().item() > 1e-3


# family -> a seed whose routing decisions are all more than 1e-3 from a tie (checked in the test)
FAMILY_SEEDS = {"glm4_moe": 4, "qwen2_moe": 3, "mixtral": 3, "mimo": 3}


def _save(directory, kind, seed):
    """A tiny checkpoint of `kind` saved by transformers (MiMo: as a Qwen2 one whose config says
    mimo); MiMo and GLM with the MTP tensors real checkpoints store, which the loader skips."""
    if kind == "mimo":
        return save_tiny_mimo(directory, seed=seed)
    model = save_tiny_hf(directory, kind, seed=seed)
    if kind == "glm4_moe":
        assert json.loads((directory / "config.json").read_text())["num_nextn_predict_layers"] == 1
        add_mtp_tensors(directory, "model.layers.2.")  # after the 2 decoder layers
    return model


@pytest.mark.parametrize("kind", sorted(FAMILY_SEEDS))
def test_family_equals_transformers_and_residency_is_bit_for_bit(megatron_cpu, fused_processors, tmp_path, kind):
    model = _save(tmp_path, kind, seed=FAMILY_SEEDS[kind])
    batch = make_batch(batch_size=2, seq_length=24, vocab_size=VOCAB, seed=0)
    assert router_margin(model, batch["tokens"]) > 1e-3
    if kind == "qwen2_moe" and not _has_shared_expert_gate():  # megatron-core 0.13.1
        with pytest.raises(UnsupportedCheckpointError, match=r"needs a megatron-core with .*moe_shared_expert_gate"):
            build_inference_model_from_hf(tmp_path, dtype=torch.float32)
        return
    want = transformers_log_probs(model, batch)
    resident = built_log_probs(build_inference_model_from_hf(tmp_path, dtype=torch.float32)[0], batch, VOCAB)
    assert (resident - want).abs().max().item() < TOL
    for residency in ("swap", "stream"):
        got = built_log_probs(build_inference_model_from_hf(tmp_path, residency=residency, dtype=torch.float32)[0],
                              batch, VOCAB)
        assert torch.equal(got, resident), residency
