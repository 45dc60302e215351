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
from megatron_rl_patches.testing.hf_checkpoints import add_mtp_tensors, save_tiny_hf, save_tiny_mimo
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


def _router_margin(model, tokens) -> float:
    """The smallest gap, over tokens and MoE layers, between the last expert chosen and the first
    one not chosen (in the scores the router ranks): a seed whose margin is under 1e-3 could route
    differently under another summation order."""
    margins = []

    def hook(module, args):
        x = args[0].reshape(-1, args[0].shape[-1]).double()
        logits = x @ module.weight.double().t()
        k = model.config.num_experts_per_tok
        if hasattr(module, "e_score_correction_bias"):  # glm4_moe: sigmoid + bias, ranked within kept groups
            ranked = logits.sigmoid() + module.e_score_correction_bias.double()
            groups = ranked.view(len(ranked), module.num_group, -1).topk(2, dim=-1)[0].sum(-1)
            top_groups = groups.topk(module.topk_group + 1, dim=-1)[0]
            margins.append((top_groups[:, -2] - top_groups[:, -1]).min().item())
            keep = groups.topk(module.topk_group, dim=-1)[1]
            per_group = ranked.shape[1] // module.num_group
            mask = torch.zeros_like(groups).scatter_(1, keep, 1.0).repeat_interleave(per_group, 1)
            ranked = ranked.masked_fill(mask == 0, -1e9)
        else:
            ranked = logits
        top = ranked.topk(k + 1, dim=-1)[0]
        margins.append((top[:, k - 1] - top[:, k]).min().item())

    handles = [m.register_forward_pre_hook(hook) for name, m in model.named_modules()
               if name.endswith(".gate") and hasattr(m, "weight") and m.weight.shape[0] > 1]
    with torch.no_grad():
        model(tokens)
    for handle in handles:
        handle.remove()
    return min(margins, default=float("inf"))


@pytest.mark.parametrize("kind", sorted(FAMILY_SEEDS))
def test_family_equals_transformers_and_residency_is_bit_for_bit(megatron_cpu, fused_processors, tmp_path, kind):
    model = _save(tmp_path, kind, seed=FAMILY_SEEDS[kind])
    batch = make_batch(batch_size=2, seq_length=24, vocab_size=VOCAB, seed=0)
    assert _router_margin(model, batch["tokens"]) > 1e-3
    want = _reference(model, batch)
    resident = _log_probs(build_inference_model_from_hf(tmp_path, dtype=torch.float32)[0], batch)
    assert (resident - want).abs().max().item() < TOL
    for residency in ("swap", "stream"):
        got = _log_probs(build_inference_model_from_hf(tmp_path, residency=residency, dtype=torch.float32)[0], batch)
        assert torch.equal(got, resident), residency
