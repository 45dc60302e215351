"""The log-prob processor's kept-set context ("kept_ids", "kept_positions", "kept_row_mask": top-p
replay) on a real tiny GPTModel with b = 2 (the [b, s] positions reordered to the hidden states'
(s, b) rows): "kept_log_probs" equals the dense keep-mask route on the model's own logits (values
and every parameter's gradient), "log_probs" and "entropy" stay unmasked; a partial context is a
ValueError naming the keys."""
from __future__ import annotations

import pytest
import torch

import megatron_rl_patches
from megatron_rl_patches import log_prob_output_processor

pytestmark = pytest.mark.megatron
V, S = 64, 16


def _gpt(megatron_cpu):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    torch.manual_seed(0)
    return GPTModel(config=megatron_cpu.config(), transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=V,
                    max_sequence_length=S, share_embeddings_and_output_weights=False)


def _nuclei(labels):
    """Tokens (b, s) with s % 3 != 0 keep 5 ids (every 4th without its label, every 5th none)."""
    g = torch.Generator().manual_seed(7)
    ids, positions = [], []
    mask = torch.zeros(labels.shape, dtype=torch.bool)
    for b in range(labels.size(0)):
        for s in range(S):
            if s % 3 == 0:
                continue
            mask[b, s] = True
            kept = [] if s % 5 == 0 else torch.randperm(V, generator=g)[:5].tolist()
            if s % 4 == 0:
                kept = [i for i in kept if i != int(labels[b, s])]
            ids += kept
            positions += [b * S + s] * len(kept)
    return torch.tensor(ids, dtype=torch.long), torch.tensor(positions, dtype=torch.long), mask


def test_kept_set_context_matches_the_dense_keep_mask_route(megatron_cpu, clean_patch_state):
    megatron_rl_patches.apply(only="gpt_output_processor")
    model = _gpt(megatron_cpu)
    batch = megatron_cpu.batch(seed=3)
    labels = batch["labels"]
    ids, positions, mask = _nuclei(labels)
    a = torch.randn(labels.shape, generator=torch.Generator().manual_seed(1))
    call = (batch["tokens"], batch["position_ids"], batch["attention_mask"])

    model.zero_grad()
    logits = model(*call) / 0.8  # [b, s, V]
    keep = torch.zeros(logits.shape, dtype=torch.bool)
    keep.view(-1, V)[positions, ids] = True
    keep.scatter_(-1, labels[..., None], True)
    dense = logits.gather(-1, labels[..., None])[..., 0] - torch.logsumexp(
        torch.where(keep | ~mask[..., None], logits, -torch.inf), -1)
    (a * dense).sum().backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    unmasked = torch.log_softmax(logits.detach(), -1).gather(-1, labels[..., None])[..., 0]

    model.zero_grad()
    out = model(*call, labels=labels, output_processor=log_prob_output_processor(temperature=0.8, with_entropy=True),
                output_processor_context={"kept_ids": ids, "kept_positions": positions, "kept_row_mask": mask})
    (a * out["kept_log_probs"]).sum().backward()
    torch.testing.assert_close(out["kept_log_probs"], dense.detach(), rtol=0, atol=2e-5)
    torch.testing.assert_close(out["log_probs"], unmasked, rtol=0, atol=2e-5)
    assert float((out["kept_log_probs"] - unmasked)[mask].abs().max()) > 1e-2  # the nuclei renormalize
    assert bool((out["kept_log_probs"][mask & (torch.arange(S) % 5 == 0)] == 0).all())  # no kept id: 0
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[name], rtol=1e-4, atol=1e-6, msg=name)

    with pytest.raises(ValueError, match="'kept_ids', 'kept_positions' and 'kept_row_mask' together"):
        model(*call, labels=labels, output_processor=log_prob_output_processor(),
              output_processor_context={"kept_ids": ids, "kept_row_mask": mask})
    tokens = labels.numel()
    for bad in ([4, tokens + 3], [-1, 4], [[4, 5]]):  # [4, b*s+3] acted as [4, 4] through % and //
        with pytest.raises(ValueError, match=rf"\['kept_positions'\] must be a 1-D tensor of flat \[b, s\] token "
                                             rf"indices in \[0, {tokens}\)"):
            model(*call, labels=labels, output_processor=log_prob_output_processor(),
                  output_processor_context={"kept_ids": torch.tensor([1, 2]), "kept_positions": torch.tensor(bad),
                                            "kept_row_mask": mask})
