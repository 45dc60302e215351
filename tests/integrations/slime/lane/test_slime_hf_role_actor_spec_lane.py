"""A Hugging Face teacher inside slime runs the actor's attention core (issue 50, item 7): a qwen3
directory of another size than the actor as the `prm_teacher` role, built inference-only by slime's
real `initialize_model_and_optimizer` (the `inference_roles` patch), with the actor on a custom local
spec (`--transformer-impl local --spec slime_kit packed_spec`: the test kit's packed CPU attention).
slime's real `forward_only` over packed batches gives the teacher's float64 log-probs (the lane
stands transformers in: the build's own unpacked forward, per sample, which the main lane holds to
transformers'), resident, streamed and swapped (bit for bit); without `--spec` (megatron-core's
local attention, the route before the fix) it is refused ("Packed sequence is not supported by
DotProductAttention")."""
from __future__ import annotations

import pytest
import torch

import megatron_rl_patches
from megatron_rl_patches.testing import layouts

pytestmark = [pytest.mark.slime, layouts.mark("thd")]

OTHER = dict(hidden_size=48, num_hidden_layers=4, intermediate_size=64, vocab_size=64, max_position_embeddings=64)
TEMPERATURE = 0.8


def test_prm_teacher_of_another_size_runs_the_actors_spec_attention(slime_cpu, tmp_path, monkeypatch):
    import slime_kit as kit  # the lane folder is on sys.path (conftest)
    from slime_ranks import ACTOR_SPEC

    from megatron_rl_patches.testing.hf_checkpoints import tiny_hf_config, write_tiny_checkpoint
    from megatron_rl_patches.testing.packed_gpt import packed_gpt_spec

    hf = str(tmp_path / "prm")
    write_tiny_checkpoint(hf, tiny_hf_config("qwen3", **OTHER), seed=5)
    reference = kit.hf_teacher_token_logps(hf, kit.rollout(0), TEMPERATURE)
    megatron_rl_patches.apply(only=["inference_roles"])
    try:
        resident, role = kit.prm_role_log_probs(hf, "prm_teacher", monkeypatch, TEMPERATURE, *ACTOR_SPEC)
        core = type(role.decoder.layers[0].self_attention.core_attention)
        streamed, _ = kit.prm_role_log_probs(hf, "prm_teacher:stream", monkeypatch, TEMPERATURE, *ACTOR_SPEC)
        swapped, _ = kit.prm_role_log_probs(hf, "prm_teacher:swap", monkeypatch, TEMPERATURE, *ACTOR_SPEC)
        with pytest.raises(AssertionError, match="Packed sequence is not supported by DotProductAttention"):
            kit.prm_role_log_probs(hf, "prm_teacher", monkeypatch, TEMPERATURE)  # the local route: no --spec
    finally:
        megatron_rl_patches.revert()
    actor_core = packed_gpt_spec().submodules.self_attention.submodules.core_attention
    assert core.__name__ == actor_core.__name__ == "PackedDotProductAttention"
    error = max((a.double() - r.double()).abs().max().item() for a, r in zip(resident, reference))
    print(f"prm_teacher (qwen3, hidden 48 x 4 layers) on the actor's --spec attention, slime forward_only vs "
          f"float64: max |Δlogp| {error:.2e}")
    assert [a.shape for a in resident] == [r.shape for r in reference]
    assert error <= 1e-4
    for a, b, c in zip(resident, streamed, swapped):
        assert torch.equal(a, b) and torch.equal(a, c)
