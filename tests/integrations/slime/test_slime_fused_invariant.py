"""`slime_fused` in the invariant mode: the same four samples as one micro-batch or as four give
every response token the same log-prob and entropy bits, the switch read off the model config's
`batch_invariant_mode` (megatron-core's TransformerConfig attribute, set on the config object: a
model cannot be built with it on CPU); the negative control, the same on every CPU: with it the
step runs the invariant code, without it (the default mode) none of it (counted; the default
fused head's values usually move with the split, but whether they do is the CPU's BLAS's choice).
A real GPTModel on CPU through the fused route's model call and the GPT output-processor patch;
its layers' output projections are zeroed so the hidden states are a function of the token alone
(the layers' own invariance is megatron-core's batch_invariant_mode on a GPU, not this package's:
docs/train-rollout-agreement.md). slime's row helpers are replaced by the package's `ops.packing`
ones (thd, one CP rank); the slime lane runs slime's own."""
from __future__ import annotations

import types

import pytest
import torch
from kit.zeroed_gpt import zeroed_output_gpt

from megatron_rl_patches.ops import packing
from megatron_rl_patches.testing.invariance import counting_invariant_calls

pytestmark = pytest.mark.megatron
TOTALS, RESPONSES = (150, 97, 211, 64), (60, 40, 130, 20)
H, V = 128, 5000


def _micro_batch(tokens, samples, monkeypatch):
    """A thd micro-batch of `samples` and slime's row helpers for it (next-token targets, response rows)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_rl_patches.integrations.slime import rows

    layout = packing.PackedLayout([TOTALS[i] for i in samples], [RESPONSES[i] for i in samples])
    parts = [tokens[i] for i in samples]
    n = sum(layout.total_lengths)
    targets = packing.shifted_targets(parts, layout, n)
    response = torch.zeros(n, dtype=torch.bool)
    for pieces in packing.response_pieces(layout, n):
        for piece in pieces:
            response[piece.start: piece.stop] = True
    monkeypatch.setattr(rows, "shifted_targets", lambda batch, length, device, ag: targets)
    monkeypatch.setattr(rows, "response_rows", lambda batch, length, device, ag: response)
    cu = torch.tensor([0, *torch.tensor(layout.total_lengths).cumsum(0).tolist()], dtype=torch.int32)
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=max(layout.total_lengths), max_seqlen_kv=max(layout.total_lengths))
    call = dict(input_ids=torch.cat(parts)[None], attention_mask=None, packed_seq_params=packed,
                position_ids=torch.cat([torch.arange(t) for t in layout.total_lengths])[None])
    return layout, call


def _responses(model, tokens, split, monkeypatch, invariant=None):
    """Per output, every sample's response values, the samples run in micro-batches of `split`
    (in the step's `invariant` mode: None, the model's own)."""
    from megatron_rl_patches.integrations.slime import fused as slime_fused

    args = types.SimpleNamespace(rollout_temperature=1.0, allgather_cp=False, loss_type="policy_loss")
    out: dict[str, list[torch.Tensor]] = {"log_probs": [], "entropy": []}
    for first in range(0, len(TOTALS), split):
        layout, call = _micro_batch(tokens, range(first, first + split), monkeypatch)
        plan = slime_fused.FusedStep(args, True, False, batch={"tokens": None}, invariant=invariant)
        with torch.no_grad():
            result = slime_fused.FusedModel(model, plan)(**call)
        assert isinstance(result, slime_fused.FusedOutput)
        for key in out:
            out[key] += packing.split_responses(result[key].reshape(-1), layout)
    return {key: torch.cat(values) for key, values in out.items()}


def test_micro_batch_splits_of_1_and_4_give_the_same_bits_with_batch_invariant_mode(
        megatron_cpu, clean_patch_state, monkeypatch):
    import megatron_rl_patches

    megatron_rl_patches.apply(only="gpt_output_processor")  # megatron-core < 0.18, as the slime lane
    model = zeroed_output_gpt(V, sum(TOTALS), hidden_size=H)
    g = torch.Generator().manual_seed(4)
    tokens = [torch.randint(0, V, (n,), generator=g) for n in TOTALS]
    seen, calls = {}, {}
    for mode in (True, False):
        model.config.batch_invariant_mode = mode  # what megatron-core's config carries on a GPU
        with counting_invariant_calls() as calls[mode]:
            seen[mode] = {split: _responses(model, tokens, split, monkeypatch) for split in (len(TOTALS), 1)}
    whole, alone = seen[True][len(TOTALS)], seen[True][1]
    for key in ("log_probs", "entropy"):
        assert whole[key].numel() == sum(RESPONSES) and torch.isfinite(whole[key]).all()
        assert torch.equal(whole[key], alone[key]), (key, float((whole[key] - alone[key]).abs().max()))
    assert calls[True].count > 0 and calls[False].count == 0, calls  # the negative control: the path taken
    torch.testing.assert_close(seen[False][len(TOTALS)]["log_probs"], whole["log_probs"], rtol=0, atol=1e-4)


def test_a_teacher_scored_inside_the_students_step_follows_the_students_mode(
        megatron_cpu, clean_patch_state, monkeypatch):
    """A teacher the package builds never sets batch_invariant_mode: inside the student's step
    (the plan slime_opd's teacher passes run with: `step_mode.student_invariant`) its fused pass
    takes the student's mode; outside, its own config's (the negative control: no invariant code
    runs there, counted on every CPU)."""
    import megatron_rl_patches
    from megatron_rl_patches.integrations.step_mode import student_invariant

    monkeypatch.delenv("MEGATRON_RL_PATCHES_INVARIANT", raising=False)
    megatron_rl_patches.apply(only="gpt_output_processor")
    teacher = zeroed_output_gpt(V, sum(TOTALS), hidden_size=H)
    g = torch.Generator().manual_seed(4)
    tokens = [torch.randint(0, V, (n,), generator=g) for n in TOTALS]
    teacher.config.batch_invariant_mode = True
    invariant = _responses(teacher, tokens, len(TOTALS), monkeypatch)
    teacher.config.batch_invariant_mode = False
    student = [types.SimpleNamespace(config=types.SimpleNamespace(batch_invariant_mode=True))]
    beside = _responses(teacher, tokens, len(TOTALS), monkeypatch, student_invariant(student))
    with counting_invariant_calls() as calls:
        alone = _responses(teacher, tokens, len(TOTALS), monkeypatch)
    for key in ("log_probs", "entropy"):
        assert torch.equal(beside[key], invariant[key]), key
    assert calls.count == 0, calls
    torch.testing.assert_close(alone["log_probs"], invariant["log_probs"], rtol=0, atol=1e-4)
