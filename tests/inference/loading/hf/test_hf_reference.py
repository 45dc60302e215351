"""Hugging Face teachers against transformers' own forward (float32, every parameter random): the
log-probs of the logits route and of the fused processor equal it to 1e-5 for each family the
converter serves; two swapped layers fail; swap/stream equal resident bit for bit; a teacher of
another hidden size and depth than the student scores its top-k ids and drives lm_head_divergence."""
from __future__ import annotations

import pytest
import torch

import megatron_rl_patches
from megatron_rl_patches import (
    build_inference_model_from_hf,
    divergence_output_processor,
    hidden_output_processor,
    log_prob_output_processor,
    topk_output_processor,
)
from megatron_rl_patches.ops.logprobs import log_probs_and_entropy
from megatron_rl_patches.testing.hf_checkpoints import save_tiny_hf, write_swapped_layers
from megatron_rl_patches.testing.megatron_cpu import make_batch

pytestmark = [pytest.mark.megatron, pytest.mark.usefixtures("transformers", "moe_router_on_cpu")]

VOCAB, SEQ = 1001, 12
TOL = 1e-5
CASES = [("qwen3", {}), ("llama", {}), ("qwen2", {}), ("qwen3_moe", {}), ("qwen3_moe", {"norm_topk_prob": False})]


def _batch(seed=0):
    return make_batch(batch_size=2, seq_length=SEQ, vocab_size=VOCAB, seed=seed)


def _args(batch):
    return batch["tokens"], batch["position_ids"], batch["attention_mask"]


def _reference(model, batch) -> torch.Tensor:
    """transformers' log-probs of every id [b, s, V] (float64 of its float32 logits)."""
    with torch.no_grad():
        return torch.log_softmax(model(batch["tokens"]).logits.double(), dim=-1)


def _label_log_probs(full, batch):
    return full.gather(-1, batch["labels"].unsqueeze(-1)).squeeze(-1)


def _teacher_log_probs(chunk, batch) -> dict[str, torch.Tensor]:
    """The two routes: logits then the log-prob op, and the fused processor (no logits)."""
    with torch.no_grad():
        logits = chunk(*_args(batch))
        routed, _ = log_probs_and_entropy(logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1),
                                          vocab_size=VOCAB)
        fused = chunk(*_args(batch), labels=batch["labels"],
                      output_processor=log_prob_output_processor(vocab_size=VOCAB))["log_probs"]
    return {"logits": routed.view_as(batch["labels"]).double(), "fused": fused.double()}


@pytest.fixture
def fused_processors(clean_patch_state):
    megatron_rl_patches.apply(only="gpt_output_processor")  # `native` on >= 0.18


@pytest.mark.parametrize(("kind", "overrides"), CASES, ids=[k + ("_unnormalized" if o else "") for k, o in CASES])
def test_log_probs_equal_transformers(megatron_cpu, fused_processors, tmp_path, kind, overrides):
    model = save_tiny_hf(tmp_path, kind, seed=3, **overrides)
    batch = _batch()
    want = _label_log_probs(_reference(model, batch), batch)
    chunks = build_inference_model_from_hf(tmp_path, dtype=torch.float32)
    assert len(chunks) == 1 and chunks[0].output_layer.weight.shape[0] == 1024  # Megatron's padded vocab
    for route, got in _teacher_log_probs(chunks[0], batch).items():
        assert (got - want).abs().max().item() < TOL, route


def test_two_swapped_layers_fail(megatron_cpu, fused_processors, tmp_path):
    """The negative control: the same checkpoint with layers 0 and 1 exchanged must not pass."""
    model = save_tiny_hf(tmp_path / "good", "qwen3", seed=3)
    write_swapped_layers(tmp_path / "good", tmp_path / "bad")
    batch = _batch()
    want = _label_log_probs(_reference(model, batch), batch)
    good = _teacher_log_probs(build_inference_model_from_hf(tmp_path / "good", dtype=torch.float32)[0], batch)
    bad = _teacher_log_probs(build_inference_model_from_hf(tmp_path / "bad", dtype=torch.float32)[0], batch)
    assert (good["fused"] - want).abs().max().item() < TOL
    assert (bad["fused"] - want).abs().max().item() > 1e-2


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe"])
def test_swap_and_stream_equal_resident_bit_for_bit(megatron_cpu, fused_processors, tmp_path, kind):
    save_tiny_hf(tmp_path, kind, seed=4)
    batch = _batch(seed=1)
    resident = build_inference_model_from_hf(tmp_path, dtype=torch.float32)[0]
    want = _teacher_log_probs(resident, batch)
    for residency in ("swap", "stream"):
        got = _teacher_log_probs(build_inference_model_from_hf(tmp_path, residency=residency, dtype=torch.float32)[0],
                                 batch)
        assert all(torch.equal(got[route], want[route]) for route in want), residency


def test_teacher_of_another_size_scores_and_distills_a_student(megatron_cpu, fused_processors, tmp_path):
    """Student: 3 layers of hidden 16 (megatron tiny GPT); teacher: 2 layers of hidden 32 (Qwen3),
    both with Megatron's padded vocab of 1024 for 1001 real ids."""
    from megatron_rl_patches.testing.megatron_cpu import build_tiny_gpt, tiny_gpt_config

    model = save_tiny_hf(tmp_path, "qwen3", seed=5)
    teacher = build_inference_model_from_hf(tmp_path, dtype=torch.float32)[0]
    student = build_tiny_gpt(tiny_gpt_config(num_layers=3, hidden_size=16, num_attention_heads=2),
                             vocab_size=1024, seq_length=SEQ, seed=6)
    batch = _batch(seed=2)
    q = _reference(model, batch)  # the teacher's distribution per transformers [b, s, V]

    # top-k OPD: the student's top-4 ids (never a padding id), scored by the teacher
    with torch.no_grad():
        own = student(*_args(batch), output_processor=topk_output_processor(k=4, vocab_size=VOCAB))
        ids = own["topk_ids"]
        scored = teacher(*_args(batch), output_processor=topk_output_processor(vocab_size=VOCAB),
                         output_processor_context={"ids": ids})
    assert int(ids.max()) < VOCAB
    assert (scored["topk_log_probs"].double() - q.gather(-1, ids)).abs().max().item() < TOL

    # lm_head_divergence: forward KL(teacher || student) per token, against a float64 reference
    with torch.no_grad():
        hidden = teacher(*_args(batch), output_processor=hidden_output_processor())
        student_logits = student(*_args(batch))[..., :VOCAB].double()
    processor = divergence_output_processor(divergence="forward_kl", vocab_size=VOCAB)
    got = student(*_args(batch), output_processor=processor,
                  output_processor_context={"teacher_hidden": hidden, "teacher_weight": teacher.output_layer.weight})
    p = torch.log_softmax(student_logits, dim=-1)
    want = (q.exp() * (q - p)).sum(-1)
    assert got.shape == want.shape
    assert (got.double() - want).abs().max().item() < TOL
    got.sum().backward()  # the student learns; the teacher holds no gradient
    assert all(param.grad is None for param in teacher.parameters())
