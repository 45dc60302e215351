"""`verl_fused_logprobs` selects the rows verl reads (`rows`) on verl 0.9.1's real engine
forward_step: responses and loss mask in, only their rows through the fused head, the rows verl
reads equal to the unselected route's, the others 0."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("verl.models", reason="verl is not installed: run `make test-verl` (the verl lane)")
pytestmark = pytest.mark.verl

import verl.models.mcore.registry  # noqa: E402,F401  (bound by name before any patch: see verl_kit)
import verl_kit as kit  # noqa: E402

import megatron_rl_patches  # noqa: E402
from megatron_rl_patches.integrations.verl import rows as verl_rows  # noqa: E402
from megatron_rl_patches.ops import lm_head  # noqa: E402
from megatron_rl_patches.testing.packed_gpt import build_packed_gpt  # noqa: E402

TEMPERATURE = 0.7
PROMPTS = (9, 4)  # of kit.LENGTHS (23, 17): responses of 14 and 13 tokens


def _model():
    from verl.models.mcore.model_forward_fused import patch_fused_forward

    model = build_packed_gpt(vocab_size=kit.VOCAB)
    patch_fused_forward(model)
    return model


def _apply() -> None:
    import inspect

    from megatron.core.models.gpt.gpt_model import GPTModel

    native = "output_processor" in inspect.signature(GPTModel.forward).parameters
    megatron_rl_patches.apply(only=["verl_fused_logprobs"] + ([] if native else ["gpt_output_processor"]))


def _rl_batch(masked_tail: int = 0):
    """kit.batch with verl's RL keys: nested prompts and responses, the loss mask on the responses
    (its last `masked_tail` tokens masked out: their log-probs are still read)."""
    micro = kit.batch(temperature=TEMPERATURE)
    seqs = micro["input_ids"].unbind()
    micro["prompts"] = kit.nested([s[:p] for s, p in zip(seqs, PROMPTS)])
    micro["responses"] = kit.nested([s[p:] for s, p in zip(seqs, PROMPTS)])
    masks = []
    for s, p in zip(seqs, PROMPTS):
        m = torch.zeros(s.numel())
        m[p: s.numel() - masked_tail] = 1.0
        masks.append(m)
    micro["loss_mask"] = kit.nested(masks)
    return micro


def _read(output, micro):
    """What verl reads: its own no_padding_2_padding slice of log-probs and entropy."""
    from verl.workers.utils.padding import no_padding_2_padding

    return {key: no_padding_2_padding(output[key], micro) for key in ("log_probs", "entropy")}


@pytest.fixture
def head_masks(monkeypatch):
    """Each fused-head call's row_mask (None: every row of its hidden states)."""
    masks = []
    real = lm_head.lm_head_log_probs_and_entropy

    def noted(hidden, *args, row_mask=None, **kwargs):
        # the processors hand the op the call's one row selection (its .mask), or a plain mask
        mask = getattr(row_mask, "mask", row_mask)
        masks.append(torch.ones(hidden.size(0), dtype=torch.bool) if mask is None else mask)
        return real(hidden, *args, row_mask=row_mask, **kwargs)

    monkeypatch.setattr(lm_head, "lm_head_log_probs_and_entropy", noted)
    return masks


def _computed(masks) -> list[int]:
    """How many rows each fused-head call computed."""
    return [int(mask.sum()) for mask in masks]


def test_the_packed_mask_is_each_sequences_read_rows_in_order(verl_cpu, head_masks):
    """Sequences that differ at their last row (read in one, not in the other): the head's row mask
    is each sequence's read rows, end to end, the last row included only where its loss mask
    holds the last token (the roll's wrap-around: a sequence's first token carries its last row)."""
    _apply()
    micro = _rl_batch()
    seqs = micro["input_ids"].unbind()
    second = torch.zeros(seqs[1].numel())
    second[PROMPTS[1]: seqs[1].numel() - 2] = 1.0
    micro["loss_mask"] = kit.nested([micro["loss_mask"].unbind()[0], second])
    kit.forward_step(kit.engine(True), _model(), micro)
    expected = []
    for n, p, last in zip(kit.LENGTHS, PROMPTS, (True, False)):
        row = torch.zeros(n, dtype=torch.bool)
        row[p - 1: n - 1] = True
        row[n - 1] = last
        expected.append(row)
    assert torch.equal(head_masks[0].cpu(), torch.cat(expected))


@pytest.mark.parametrize("masked_tail", [0, 3], ids=["loss-mask-all", "loss-mask-tail-off"])
def test_only_read_rows_meet_the_head_and_match_every_row(verl_cpu, head_masks, monkeypatch, masked_tail):
    _apply()
    model = _model()
    micro = _rl_batch(masked_tail)
    selected = kit.forward_step(kit.engine(True), model, micro)
    monkeypatch.setenv(verl_rows.settings.VERL_ROWS, "all")
    every = kit.forward_step(kit.engine(True), model, _rl_batch(masked_tail))
    responses = [n - p for n, p in zip(kit.LENGTHS, PROMPTS)]
    # each response's rows, plus the last row while the loss mask holds the last token (a mask
    # read in either alignment: position t at row t)
    assert _computed(head_masks) == [sum(r + (masked_tail == 0) for r in responses), sum(kit.LENGTHS)]
    got, want = _read(selected, micro), _read(every, micro)
    for key in got:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=2e-6)
    log_probs, _ = kit.reference(model, micro, TEMPERATURE)
    for row, ref, n, r in zip(kit.rows(selected["log_probs"]), log_probs, kit.LENGTHS, responses):
        assert (row[n - r - 1: n - 1].double() - ref[n - r - 1: n - 1]).abs().max() < 1e-5
        assert torch.equal(row[: n - r - 1], torch.zeros(n - r - 1))  # prompt rows: 0, never computed


def test_gradients_through_the_read_rows_match_every_row(verl_cpu, monkeypatch):
    _apply()
    model = _model()

    def grads():
        micro = _rl_batch()
        read = _read(kit.forward_step(kit.engine(True), model, micro), micro)
        model.zero_grad(set_to_none=True)
        weights = torch.linspace(-1, 1, read["log_probs"].size(1))
        ((read["log_probs"] * weights).sum() + 0.3 * read["entropy"].sum()).backward()
        return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    selected = grads()
    monkeypatch.setenv(verl_rows.settings.VERL_ROWS, "all")
    every = grads()
    assert selected.keys() == every.keys()
    for name in selected:
        torch.testing.assert_close(selected[name], every[name], rtol=1e-5, atol=1e-6, msg=name)


def test_a_batch_without_responses_or_loss_mask_selects_every_row(verl_cpu, head_masks):
    _apply()
    model = _model()
    micro = kit.batch(temperature=TEMPERATURE)
    del micro["loss_mask"]
    assert verl_rows.read_rows(micro) is None
    kit.forward_step(kit.engine(True), model, kit.batch(temperature=TEMPERATURE))  # loss mask all ones
    assert _computed(head_masks) == [sum(kit.LENGTHS)]


def test_read_rows_of_a_padded_attention_mask_batch():
    """Responses given as padded tensors: their lengths come from the attention mask, as in
    no_padding_2_padding."""
    from verl.utils import tensordict_utils as tu

    ids = kit.nested([torch.arange(6), torch.arange(4)])
    prompts = torch.zeros(2, 3, dtype=torch.long)
    attention = torch.tensor([[1, 1, 1, 1, 1, 1, 0], [0, 1, 1, 1, 1, 0, 0]])  # responses of 3 and 2
    micro = tu.get_tensordict({"input_ids": ids, "prompts": prompts, "responses": torch.zeros(2, 4, dtype=torch.long),
                               "attention_mask": attention}, {})
    rows = verl_rows.read_rows(micro).tolist()
    assert rows[:6] == [False, False, True, True, True, False]
    assert rows[6:] == [False, True, True, False]


def test_read_rows_of_the_loss_mask_stay_inside_each_sequence():
    """A loss mask on the first token of a sequence selects that row, never the row before it,
    which is the previous sequence's last (its rolled filler)."""
    from verl.utils import tensordict_utils as tu

    ids = kit.nested([torch.arange(4), torch.arange(3), torch.arange(2)])
    loss = kit.nested([torch.tensor([0, 0, 1, 0]), torch.tensor([1, 0, 0]), torch.tensor([0, 1])])
    rows = verl_rows.read_rows(tu.get_tensordict({"input_ids": ids, "loss_mask": loss}, {})).tolist()
    assert rows == [False, True, True, False, True, False, False, True, True]


def test_no_batch_iterator_is_verls_own_error(verl_cpu):
    """forward_step without an iterator fails as verl's own code does (next() of None), not in the wrapper."""
    _apply()
    with pytest.raises(TypeError, match="not an iterator"):
        kit.engine(True).forward_step(None, _model(), None, None)
