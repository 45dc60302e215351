"""`output_processor_context={"row_mask": [b, s]}` on a real tiny GPTModel: the log-prob and top-k
processors compute only those tokens (equal to the unmasked processor there, 0 elsewhere), and
the model's gradients equal the unmasked processor's with the unselected tokens' upstream 0."""
from __future__ import annotations

import pytest
import torch

import megatron_rl_patches
from megatron_rl_patches import log_prob_output_processor, topk_output_processor

pytestmark = pytest.mark.megatron


def _gpt(megatron_cpu):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    torch.manual_seed(0)
    return GPTModel(config=megatron_cpu.config(), transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=64,
                    max_sequence_length=16, share_embeddings_and_output_weights=False)


def test_row_mask_context_selects_tokens(megatron_cpu, clean_patch_state):
    megatron_rl_patches.apply(only="gpt_output_processor")
    model = _gpt(megatron_cpu)
    batch = megatron_cpu.batch(seed=3)
    rows = torch.zeros(2, 16, dtype=torch.bool)
    rows[0, 5:12], rows[1, 9:] = True, True  # the response spans
    a = torch.randn(2, 16, generator=torch.Generator().manual_seed(1))
    processor = log_prob_output_processor(with_entropy=True)
    outs, grads = [], []
    for context, weight in ((None, a * rows), ({"row_mask": rows}, a)):
        model.zero_grad()
        out = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"],
                    output_processor=processor, output_processor_context=context)
        ((weight * out["log_probs"]).sum() + (weight * out["entropy"]).sum()).backward()
        outs.append(out)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    full, sel = outs
    for key in ("log_probs", "entropy"):
        torch.testing.assert_close(sel[key][rows], full[key][rows], rtol=1e-5, atol=1e-6)
        assert bool((sel[key][~rows] == 0).all())
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-4, atol=1e-6)

    topk = topk_output_processor(k=3)
    with torch.no_grad():
        full = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], output_processor=topk)
        sel = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], output_processor=topk,
                    output_processor_context={"row_mask": rows})
    assert torch.equal(sel["topk_ids"][rows], full["topk_ids"][rows])
    torch.testing.assert_close(sel["topk_log_probs"][rows], full["topk_log_probs"][rows], rtol=1e-5, atol=1e-6)
    assert bool((sel["tail"][~rows] == 0).all() and (sel["topk_ids"][~rows] == 0).all())
