"""The families the package loads from Hugging Face checkpoints (every parameter random), built
inference-only as teachers and references are, run under a shared-prefix plan against each sample's
own forward (unpacked, its own causal mask): log-probs within 1e-5 (float32) for a dense Qwen3, a
Llama 3.1 with its RoPE scaling, Qwen2 with YaRN, an MoE (Qwen3-MoE) and DeepSeek-V3 (multi-latent
attention with its own YaRN table, MoE) and Qwen3.5 (the package's inference gated delta net layer,
Qwen3-Next's too: each remainder continues its prompt's recurrent state and convolution window,
across the 64-row chunk of its recurrence)."""
from __future__ import annotations

import pytest
import torch
from kit.latent_gpt import mla_takes_packed_input
from kit.shared_prefix import grpo_batch

from megatron_rl_patches import build_inference_model_from_hf, log_probs_and_entropy
from megatron_rl_patches.inference.loading.hf import UnsupportedCheckpointError
from megatron_rl_patches.shared_prefix import (
    check_shared_prefix,
    plan_shared_prefix,
    prepare_shared_prefix,
    shared_prefix_params,
)
from megatron_rl_patches.testing.hf_checkpoints import save_tiny_hf

pytestmark = [pytest.mark.megatron, pytest.mark.usefixtures("moe_router_on_cpu")]

VOCAB, TOL = 1001, 1e-5
LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
FAMILIES = {
    "qwen3": ("qwen3", {}),
    "llama 3.1 rope scaling": ("llama", {"rope_parameters": LLAMA3, "hidden_size": 64, "head_dim": 16}),
    "qwen2 yarn": ("qwen2", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                 "original_max_position_embeddings": 32}}),
    "qwen3_moe": ("qwen3_moe", {}),
    "deepseek_v3": ("deepseek_v3", {}),  # multi-latent attention (its own YaRN table) and MoE
    "qwen3_5_text": ("qwen3_5_text", {}),  # gated delta nets 3:1 with gated attention (Qwen3-Next's: the same layer)
}


def _own_log_probs(chunk, sequence: list[int]) -> torch.Tensor:
    """log p(next token) of a sample's rows from its own forward (its last row predicts nothing)."""
    tokens = torch.tensor(sequence)[None]
    causal = ~torch.ones(len(sequence), len(sequence), dtype=torch.bool).tril()
    logits = chunk(tokens, torch.arange(len(sequence))[None], causal[None, None])
    return log_probs_and_entropy(logits[0, :-1], tokens[0, 1:], vocab_size=VOCAB)[0]


def _has_yarn() -> bool:
    from megatron.core.transformer import attention

    return hasattr(attention, "_yarn_get_concentration_factor_from_config")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_family_under_the_plan_equals_each_samples_own_forward(megatron_cpu, tmp_path, family):
    kind, overrides = FAMILIES[family]
    if family == "qwen2 yarn" and not _has_yarn():
        pytest.skip("YaRN needs megatron-core >= 0.16 (the package refuses it before)")
    save_tiny_hf(tmp_path, kind, seed=2, max_position_embeddings=256, **overrides)
    try:
        chunk = build_inference_model_from_hf(tmp_path, dtype=torch.float32)[0]
    except UnsupportedCheckpointError as exc:  # megatron-core 0.13 builds no Qwen3.5: nothing to plan
        pytest.skip(str(exc))
    if family == "deepseek_v3" and not mla_takes_packed_input():  # megatron-core 0.13: refused, never run
        with pytest.raises(ValueError, match="multi-latent attention on megatron-core 0.13"):
            check_shared_prefix([chunk], training=False)
        return
    check_shared_prefix([chunk], training=False)
    batch = grpo_batch(((70, (6, 3, 9, 4)),), (11,), padding=3, vocab=VOCAB, seed=4)
    plan = plan_shared_prefix(batch.tokens, batch.cu_seqlens, samples=batch.samples)
    prepare_shared_prefix(chunk)
    with torch.no_grad():
        logits = chunk(batch.tokens, None, None, packed_seq_params=shared_prefix_params(plan))
        starts = batch.cu_seqlens.tolist()
        for i, sequence in enumerate(batch.sequences):
            rows = slice(starts[i], starts[i] + len(sequence) - 1)
            got = log_probs_and_entropy(logits[0, rows], batch.tokens[0, starts[i] + 1:starts[i] + len(sequence)],
                                        vocab_size=VOCAB)[0]
            assert (got - _own_log_probs(chunk, sequence)).abs().max() < TOL, f"sample {i}"
    assert plan.stats.physical_tokens == 70 + 6 + 3 + 9 + 4 + 11

