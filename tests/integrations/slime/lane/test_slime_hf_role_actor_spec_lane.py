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
NO_PADDING = ("--make-vocab-size-divisible-by", "64")  # the teacher's 64 ids unpadded: every logit is real


def _float64_log_probs(kit, hf: str, data) -> list[torch.Tensor]:
    """Per sample, log p(response token) at the rollout temperature from the teacher built alone in
    float64 (megatron-core's local attention, one unpacked sample at a time)."""
    logps = kit.hf_teacher_logps(hf, data, TEMPERATURE, kit.VOCAB)
    return [logp.gather(-1, tokens[-len(logp):, None])[:, 0] for logp, tokens in zip(logps, data["tokens"])]


def _role_log_probs(kit, hf: str, roles: str, monkeypatch, *flags: str) -> tuple[list[torch.Tensor], type]:
    """The prm_teacher role built by slime's initialize_model_and_optimizer, then slime's
    forward_only log-probs over the kit's packed rollout; and the role's attention core class."""
    from slime.backends.megatron_utils import model as slime_model

    monkeypatch.setenv("MEGATRON_RL_PATCHES_INFERENCE_ROLES", roles)
    with kit.slime_session(*NO_PADDING, *flags, rollout_temperature=TEMPERATURE, prm_teacher_load=hf) as args:
        model, optimizer, scheduler, iteration = slime_model.initialize_model_and_optimizer(args, role="prm_teacher")
        assert optimizer is None and scheduler is None and iteration == 0 and model[0].role == "prm_teacher"
        inner = model[0]
        while hasattr(inner, "module"):
            inner = inner.module
        core = type(inner.decoder.layers[0].self_attention.core_attention)
        return kit.log_probs(args, model, kit.rollout(0))["log_probs"], core


def test_prm_teacher_of_another_size_runs_the_actors_spec_attention(slime_cpu, tmp_path, monkeypatch):
    import slime_kit as kit  # the lane folder is on sys.path (conftest)
    from slime_ranks import ACTOR_SPEC

    from megatron_rl_patches.testing.hf_checkpoints import tiny_hf_config, write_tiny_checkpoint
    from megatron_rl_patches.testing.packed_gpt import packed_gpt_spec

    hf = str(tmp_path / "prm")
    write_tiny_checkpoint(hf, tiny_hf_config("qwen3", **OTHER), seed=5)
    reference = _float64_log_probs(kit, hf, kit.rollout(0))
    megatron_rl_patches.apply(only=["inference_roles"])
    try:
        resident, core = _role_log_probs(kit, hf, "prm_teacher", monkeypatch, *ACTOR_SPEC)
        streamed, _ = _role_log_probs(kit, hf, "prm_teacher:stream", monkeypatch, *ACTOR_SPEC)
        swapped, _ = _role_log_probs(kit, hf, "prm_teacher:swap", monkeypatch, *ACTOR_SPEC)
        with pytest.raises(AssertionError, match="Packed sequence is not supported by DotProductAttention"):
            _role_log_probs(kit, hf, "prm_teacher", monkeypatch)  # the local route: no --spec
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
