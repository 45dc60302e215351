"""inference_forward and token_log_probs on an inference-only build (real megatron-core on CPU)."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.megatron


def _logits_step(data_iterator, model):
    batch = next(data_iterator)
    from megatron_rl_patches.testing.megatron_cpu import gpt_forward

    return gpt_forward(model, batch), batch["labels"]


def test_inference_forward_returns_logits_and_log_probs(megatron_cpu_kind):
    from megatron_rl_patches import build_inference_model
    from megatron_rl_patches.inference import inference_forward, token_log_probs

    chunks = build_inference_model(megatron_cpu_kind.model_provider(seed=61))
    batches = [megatron_cpu_kind.batch(seed=i) for i in range(3)]
    sizes = dict(num_microbatches=3, seq_length=16, micro_batch_size=2)

    logits = inference_forward(chunks, iter(batches), _logits_step, **sizes)
    assert len(logits) == 3
    for out, batch in zip(logits, batches):
        assert torch.equal(out, megatron_cpu_kind.forward(chunks[0], batch))
        assert not out.requires_grad

    temperature = 0.7
    collect = token_log_probs(temperature=temperature, with_entropy=True)
    results = inference_forward(chunks, iter(batches), _logits_step, collect=collect, **sizes)
    for result, out, batch in zip(results, logits, batches):
        reference = torch.log_softmax(out.double() / temperature, dim=-1)
        expected = reference.gather(-1, batch["labels"].unsqueeze(-1)).squeeze(-1)
        entropy = -(reference.exp() * reference).sum(-1)
        assert result["log_probs"].shape == batch["labels"].shape
        torch.testing.assert_close(result["log_probs"].double(), expected, rtol=0, atol=2e-6)
        torch.testing.assert_close(result["entropy"].double(), entropy, rtol=0, atol=2e-6)

    with pytest.raises(ValueError, match="num_microbatches must be a positive int"):
        inference_forward(chunks, iter(batches), _logits_step, num_microbatches=0, seq_length=16, micro_batch_size=2)
    with pytest.raises(TypeError, match="needs the target token ids"):
        inference_forward(
            chunks,
            iter(batches),
            lambda it, m: megatron_cpu_kind.forward(m, next(it)),
            collect=token_log_probs(),
            **sizes,
        )
