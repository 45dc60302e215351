"""The whole-vocabulary route's refusals on verl 0.9.1's real engine `forward_step`, before any
request (no server needed): context parallelism, named with the way out; a privileged context the
teacher cannot score. And without a head in the entry the fused route is verl's own (no teacher
asked)."""
from __future__ import annotations

import pytest

pytest.importorskip("verl.models", reason="verl is not installed: run `make test-verl` (the verl lane)")
pytestmark = pytest.mark.verl

import verl.models.mcore.registry  # noqa: E402,F401  (bound by name before any patch: see verl_kit)
import verl_kit as kit  # noqa: E402

import megatron_rl_patches  # noqa: E402

VARIABLE = "MEGATRON_RL_PATCHES_VERL_TEACHER"
NOWHERE = "http://127.0.0.1:9"  # the discard port: the refusals come before any request


def _model():
    from verl.models.mcore.model_forward_fused import patch_fused_forward

    from megatron_rl_patches.testing.packed_gpt import build_packed_gpt

    model = build_packed_gpt(vocab_size=kit.VOCAB, seed=3)
    patch_fused_forward(model)
    return model


def test_context_parallelism_is_refused_by_name_before_any_request(verl_cpu, monkeypatch, tmp_path):
    monkeypatch.setenv(VARIABLE, f"{NOWHERE};engine=vllm;head={tmp_path}")
    megatron_rl_patches.apply(only=["verl_fused_logprobs", "verl_topk_kd"])
    batch = kit.rl_batch(kit.PROMPTS, kit.RESPONSES, distillation_use_topk=True, local_cp_size=2)
    with pytest.raises(ValueError, match=rf"{VARIABLE} with head=.*context parallelism is not served.*unset head="):
        kit.forward_step(kit.engine(True), _model(), batch)


def test_without_a_head_the_fused_route_is_verls_own(verl_cpu, monkeypatch):
    monkeypatch.setenv(VARIABLE, f"{NOWHERE};engine=vllm")
    megatron_rl_patches.apply(only=["verl_fused_logprobs", "verl_topk_kd"])
    output = kit.forward_step(kit.engine(True), _model(), kit.rl_batch(kit.PROMPTS, kit.RESPONSES))
    assert "distillation_losses" not in output and "log_probs" in output


def test_a_privileged_context_the_teacher_cannot_score_is_refused_naming_the_sample_before_any_request(
        verl_cpu, monkeypatch, tmp_path):
    """`;context=hint` on the whole-vocabulary route (scored exactly in test_verl_served_vocab.py):
    a micro-batch without the field, and ids past the teacher's vocabulary, refused naming the
    key (and the sample) before the server is asked."""
    import numpy as np

    from megatron_rl_patches.testing.hf_checkpoints import save_tiny_hf

    save_tiny_hf(tmp_path, "qwen3", seed=7, hidden_size=64, head_dim=32, intermediate_size=96, vocab_size=kit.VOCAB)
    monkeypatch.setenv(VARIABLE, f"{NOWHERE};engine=vllm;head={tmp_path};context=hint")
    megatron_rl_patches.apply(only=["verl_fused_logprobs", "verl_topk_kd"])
    batch = kit.rl_batch(kit.PROMPTS, kit.RESPONSES, distillation_use_topk=True)
    with pytest.raises(ValueError, match=rf"{VARIABLE} with head= and context=\): the trainer's micro-batch has no "
                                         r"non-tensor field 'hint'"):
        kit.forward_step(kit.engine(True), _model(), batch)
    batch = kit.rl_batch(kit.PROMPTS, kit.RESPONSES, distillation_use_topk=True,
                         hint=[np.array([3, 4]), np.array([5, kit.VOCAB])])
    with pytest.raises(ValueError, match=rf"sample 1's context under 'hint' holds id {kit.VOCAB}, past the teacher's "
                                         rf"vocabulary of {kit.VOCAB}"):
        kit.forward_step(kit.engine(True), _model(), batch)


def test_with_a_head_a_micro_batch_that_is_not_distillation_is_verls_own(verl_cpu, monkeypatch, tmp_path):
    """The entry names a head, but this micro-batch asks no distillation (an old-log-prob pass): handed
    to verl's own forward as it came, no teacher asked (the discard port would refuse any request)."""
    monkeypatch.setenv(VARIABLE, f"{NOWHERE};engine=vllm;head={tmp_path}")
    megatron_rl_patches.apply(only=["verl_fused_logprobs", "verl_topk_kd"])
    output = kit.forward_step(kit.engine(True), _model(), kit.rl_batch(kit.PROMPTS, kit.RESPONSES))
    assert "distillation_losses" not in output and "log_probs" in output
