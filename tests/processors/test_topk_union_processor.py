"""topk_output_processor(union=True): a teacher's pass takes the student's ids, selects its own
top-k and scores the union; the student's pass scores it with the mask (the union data flow of
docs/distillation.md), on real megatron-core GPT models."""
from __future__ import annotations

import pytest
import torch

import megatron_rl_patches
from megatron_rl_patches import topk_ids, topk_kl, topk_logprobs, topk_output_processor, union_ids

pytestmark = pytest.mark.megatron


def _gpt(megatron_cpu, seed: int):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    torch.manual_seed(seed)
    return GPTModel(config=megatron_cpu.config(), transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=64,
                    max_sequence_length=16)


def test_union_data_flow_student_ids_first(megatron_cpu, clean_patch_state):
    megatron_rl_patches.apply(only="gpt_output_processor")
    student, teacher = _gpt(megatron_cpu, 0), _gpt(megatron_cpu, 1)
    batch = megatron_cpu.batch(seed=3)
    args = (batch["tokens"], batch["position_ids"], batch["attention_mask"])
    with torch.no_grad():  # 1. the student's (old policy's) ids
        chosen = student(*args, output_processor=topk_output_processor(k=4))["topk_ids"]
        # 2. the teacher's pass: its own top-4, the union scored, padding masked
        scored = teacher(*args, output_processor=topk_output_processor(k=4, union=True),
                         output_processor_context={"ids": chosen})
        s_logits, t_logits = megatron_cpu.forward(student, batch), megatron_cpu.forward(teacher, batch)
    ids, mask = union_ids(chosen, topk_ids(t_logits, 4))
    assert torch.equal(scored["topk_ids"], ids) and torch.equal(scored["ids_mask"], mask)
    assert bool((~mask).any()) and bool(mask[..., :4].all())
    t_lp, t_tail = topk_logprobs(t_logits, ids, ids_mask=mask)
    torch.testing.assert_close(scored["topk_log_probs"], t_lp, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(scored["tail"], t_tail, rtol=2e-6, atol=2e-6)
    # 3. the student's training pass scores the union with the mask; 4. the loss
    out = student(*args, output_processor=topk_output_processor(),
                  output_processor_context={"ids": scored["topk_ids"], "ids_mask": scored["ids_mask"]})
    s_lp, s_tail = topk_logprobs(s_logits, ids, ids_mask=mask)
    torch.testing.assert_close(out["topk_log_probs"], s_lp, rtol=2e-6, atol=2e-6)
    loss = topk_kl(out["topk_log_probs"], out["tail"], scored["topk_log_probs"], scored["tail"],
                   ids_mask=scored["ids_mask"], divergence="jsd")
    loss.sum().backward()
    assert loss.shape == mask.shape[:2] and bool(torch.isfinite(loss).all())
    assert all(p.grad is None or bool(torch.isfinite(p.grad).all()) for p in student.parameters())


def test_union_needs_k_and_unpadded_context_ids(megatron_cpu, clean_patch_state):
    megatron_rl_patches.apply(only="gpt_output_processor")
    model = _gpt(megatron_cpu, 0)
    batch = megatron_cpu.batch(seed=4)
    args = (batch["tokens"], batch["position_ids"], batch["attention_mask"])
    ids = torch.zeros(*batch["tokens"].shape, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="union=True"):
        model(*args, output_processor=topk_output_processor(k=2, union=True))
    with pytest.raises(ValueError, match="union=True"):
        model(*args, output_processor=topk_output_processor(union=True), output_processor_context={"ids": ids})
    with pytest.raises(TypeError, match="union must be True or False"):
        topk_output_processor(k=2, union=1)
