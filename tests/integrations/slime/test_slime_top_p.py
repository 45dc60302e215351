"""`slime_fused`'s top-p context without slime's source (the lane runs slime's own slicing): each
sample's nuclei (slime's flat ids and offsets) land on the packed rows of their response tokens,
empty nuclei mark their row with no id, tokens past the offsets stay unmarked (full vocabulary),
bad offsets are a ValueError naming the key, and a batch without top-p keys gives no context."""
from __future__ import annotations

import types

import pytest
import torch

from megatron_rl_patches.integrations.slime import rows as slime_rows
from megatron_rl_patches.integrations.slime.top_p import kept_context


@pytest.fixture
def cp1_slicing(monkeypatch):
    """slime's slicing at context-parallel size 1: sample i's response rows are the logits rows
    [end - R - 1, end - 1); its response tokens in order."""

    def positions(batch, length, device, allgather_cp):
        out, offset = [], 0
        for total, response in zip(batch["total_lengths"], batch["response_lengths"]):
            end = offset + total
            out.append(torch.arange(end - response - 1, end - 1))
            offset = end
        return out

    loss = types.SimpleNamespace(slice_log_prob_with_cp=lambda values, total, response: values)
    monkeypatch.setattr(slime_rows, "response_positions", positions)
    monkeypatch.setattr(slime_rows, "slime_loss", lambda: loss)


def _batch(**top_p):
    return {"total_lengths": [5, 6], "response_lengths": [3, 4], **top_p}


def test_nuclei_land_on_their_response_rows(cp1_slicing):
    # sample 0: tokens keep {7, 8}, {} (empty), {3}; sample 1: only its first two tokens are covered
    ctx = kept_context(_batch(rollout_top_p_token_ids=[torch.tensor([7, 8, 3], dtype=torch.int32), [9, 1, 2]],
                              rollout_top_p_token_offsets=[torch.tensor([0, 2, 2, 3]), [0, 1, 3]]), 11, "cpu")
    assert ctx is not None
    assert ctx["kept_ids"].tolist() == [7, 8, 3, 9, 1, 2]
    assert ctx["kept_positions"].tolist() == [1, 1, 3, 6, 7, 7]
    want = torch.zeros(1, 11, dtype=torch.bool)
    want[0, [1, 2, 3, 6, 7]] = True  # row 2: an empty nucleus (log-prob 0); rows 8, 9: past the offsets
    assert torch.equal(ctx["kept_row_mask"], want)


def test_bad_offsets_are_refused_and_no_keys_give_no_context(cp1_slicing):
    with pytest.raises(ValueError, match="rollout_top_p_token_offsets must be non-decreasing"):
        kept_context(_batch(rollout_top_p_token_ids=[[1, 2], []], rollout_top_p_token_offsets=[[0, 2, 1, 2], [0]]),
                     11, "cpu")
    with pytest.raises(ValueError, match="end within rollout_top_p_token_ids"):
        kept_context(_batch(rollout_top_p_token_ids=[[1], []], rollout_top_p_token_offsets=[[0, 1, 3], [0]]), 11,
                     "cpu")
    with pytest.raises(ValueError, match=r"rollout_top_p_token_offsets must start at 0 or above .* got \[-1, 1"):
        kept_context(_batch(rollout_top_p_token_ids=[[1, 2], []], rollout_top_p_token_offsets=[[-1, 1, 2], [0]]),
                     11, "cpu")  # token 0 would keep ids[-1], another token's id
    assert kept_context(_batch(), 11, "cpu") is None


@pytest.mark.megatron
def test_top_p_and_top_k_buckets_in_one_fused_call(megatron_cpu, clean_patch_state):
    """top-p replay beside top-k OPD (`with_topk`): the kept-set keys reach the log-prob processor
    only (the top-k one accepts none of them), and each result equals its processor run alone."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    import megatron_rl_patches
    from megatron_rl_patches import log_prob_output_processor, topk_output_processor
    from megatron_rl_patches.processors.combined import with_topk

    megatron_rl_patches.apply(only="gpt_output_processor")
    torch.manual_seed(0)
    model = GPTModel(config=megatron_cpu.config(), transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=64,
                     max_sequence_length=16)
    batch = megatron_cpu.batch(seed=3)
    call = dict(input_ids=batch["tokens"], position_ids=batch["position_ids"], attention_mask=batch["attention_mask"],
                labels=batch["labels"])
    rows = torch.ones(batch["labels"].shape, dtype=torch.bool)
    kept = {"kept_ids": torch.tensor([3, 9, 9, 40]), "kept_positions": torch.tensor([0, 0, 5, 17]),
            "kept_row_mask": rows & (torch.arange(16) < 8)}
    log_prob = log_prob_output_processor(with_entropy=True)
    with torch.no_grad():
        both = model(**call, output_processor=with_topk(log_prob, 3, {}, {}),
                     output_processor_context={"row_mask": rows, **kept})
        alone = model(**call, output_processor=log_prob, output_processor_context={"row_mask": rows, **kept})
        topk = model(**call, output_processor=topk_output_processor(k=3), output_processor_context={"row_mask": rows})
    for key in ("log_probs", "entropy", "kept_log_probs"):
        torch.testing.assert_close(both[key], alone[key], rtol=0, atol=0)
    for key in ("topk_ids", "topk_log_probs", "tail"):
        torch.testing.assert_close(both[key], topk[key], rtol=0, atol=1e-6)
    assert float((both["kept_log_probs"] - both["log_probs"]).abs().max()) > 1e-2
