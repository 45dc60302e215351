"""slime_opd's step ids with a teacher of the student's tokenizer beside one of another tokenizer:
the step scores the student's top-k ids and the other teacher's bucket ids side by side, and the
parts share ids wherever the teachers agree with the student (its top id in a teacher's top
string's bucket). The top-k op scores each id of a row once, so before the fix such a row was a
ValueError at the training step ("ids must not repeat within a row"; the negative control); now a
repeat is scored once and read by each part (`step_repeats`): `opd_terms.loss_terms` equals each
part scored by its own op call, values and gradients, and with no repeats nothing changes."""
from __future__ import annotations

import pytest
import torch

from megatron_rl_patches.integrations.megatron.opd import opd_terms, step_repeats
from megatron_rl_patches.integrations.megatron.opd import topk_request as keys
from megatron_rl_patches.integrations.megatron.opd.opd_settings import opd_settings
from megatron_rl_patches.ops.lm_head import lm_head_topk_logprobs

R, H, V, K, D = 6, 8, 40, 3, 2
SETTINGS = {"MEGATRON_RL_PATCHES_OPD_TEACHERS": "/s,/t;tokenizer=own", "MEGATRON_RL_PATCHES_OPD_WEIGHTS": "0.4,0.6",
            "MEGATRON_RL_PATCHES_OPD_K": str(K)}


def test_a_repeated_id_is_masked_and_points_to_its_first_column():
    ids = torch.tensor([[5, 3, 9, 5, 0, 3, 7], [1, 2, 3, 4, 5, 6, 7], [4, 4, 4, 0, 0, 0, 1]])
    mask = torch.tensor([[1, 1, 1, 1, 0, 1, 1], [1, 1, 1, 1, 1, 1, 1], [1, 0, 1, 1, 1, 0, 1]], dtype=torch.bool)
    once, same_as = step_repeats.unrepeated(ids, mask)
    assert same_as.tolist() == [[-1, -1, -1, 0, -1, 1, -1], [-1] * 7, [-1, -1, 0, -1, 3, -1, -1]]
    assert torch.equal(once, mask & (same_as < 0))


def _batch(repeats: bool) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """A micro-batch of one sample: the student's top-k ids [R, K], the other teacher's bucket ids
    [R, K·D] (padding slots off; with `repeats`, rows 0, 2 and 4 hold one of the student's ids);
    the hidden states and the output weight of the student."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(R, H, generator=gen, dtype=torch.float64)
    weight = torch.randn(V, H, generator=gen, dtype=torch.float64)
    same = torch.stack([torch.randperm(V // 2, generator=gen)[:K] for _ in range(R)])
    cross = torch.stack([V // 2 + torch.randperm(V // 2, generator=gen)[:K * D] for _ in range(R)])
    cross_mask = torch.rand(R, K * D, generator=gen) > 0.3
    cross_mask[:, 0::D] = True  # each bucket's first slot
    if repeats:
        for row in (0, 2, 4):
            cross[row, D] = same[row, row % K]
    alive = torch.ones(R, 1, K, dtype=torch.bool)
    batch = {keys.IDS: [same], keys.STEP_IDS: [torch.cat([same, cross], 1)],
             keys.STEP_MASK: [torch.cat([torch.ones_like(same, dtype=torch.bool), cross_mask], 1)],
             keys.TEACHER_LOGPROBS: [torch.log_softmax(torch.randn(1, R, K + 1, generator=gen), -1)[..., :K]],
             keys.TEACHER_TAILS: [torch.full((1, R), -2.0)],
             keys.CROSS_RATIO: [torch.randn(R, 1, generator=gen) * 0.1],
             keys.CROSS_LOGPROBS: [torch.log_softmax(torch.randn(R, 1, K + 1, generator=gen), -1)[..., :K]],
             keys.CROSS_TAILS: [torch.full((R, 1), -1.5)], keys.CROSS_ALIVE: [alive],
             keys.CROSS_TEACHERS: [torch.tensor([1])]}
    return batch, hidden, weight


def _loss(batch: dict, hidden: torch.Tensor, weight: torch.Tensor, per_part: bool) -> tuple[torch.Tensor, ...]:
    """loss_terms' sum and its gradient to the hidden states; the student's columns scored in one op
    call over the step's ids (as the step does), or (`per_part`) each part by its own call."""
    hidden = hidden.clone().requires_grad_()
    ids, mask = batch[keys.STEP_IDS][0], batch[keys.STEP_MASK][0]
    if per_part:
        parts = [lm_head_topk_logprobs(hidden, weight, ids[:, cols], ids_mask=mask[:, cols])
                 for cols in (slice(0, K), slice(K, None))]
        student, tail = torch.cat([lp for lp, _ in parts], 1), parts[0][1]
    else:
        student, tail = lm_head_topk_logprobs(hidden, weight, ids, ids_mask=mask)
    token = torch.zeros(R, dtype=torch.float64)
    total = opd_terms.loss_terms(opd_settings(SETTINGS), batch, student, tail, token).sum()
    total.backward()
    return total.detach(), hidden.grad


def test_a_repeat_across_the_parts_is_scored_once_and_read_by_each_part():
    batch, hidden, weight = _batch(repeats=True)
    with pytest.raises(ValueError, match="ids must not repeat within a row"):  # the step before the fix
        _loss(batch, hidden, weight, per_part=False)
    reference = _loss(batch, hidden, weight, per_part=True)
    once, same_as = step_repeats.unrepeated(batch[keys.STEP_IDS][0], batch[keys.STEP_MASK][0])
    assert int((same_as >= 0).sum()) == 3
    fixed = {**batch, keys.STEP_MASK: [once], keys.STEP_SAME_AS: [same_as]}
    got = _loss(fixed, hidden, weight, per_part=False)
    torch.testing.assert_close(got[0], reference[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got[1], reference[1], rtol=1e-12, atol=1e-12)


def test_without_repeats_the_step_is_unchanged():
    batch, hidden, weight = _batch(repeats=False)
    once, same_as = step_repeats.unrepeated(batch[keys.STEP_IDS][0], batch[keys.STEP_MASK][0])
    assert torch.equal(once, batch[keys.STEP_MASK][0]) and bool((same_as < 0).all())
    before = _loss(batch, hidden, weight, per_part=False)
    after = _loss({**batch, keys.STEP_SAME_AS: [same_as]}, hidden, weight, per_part=False)
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])


def test_the_loss_reads_which_teachers_gave_grouped_buckets_from_their_scores():
    """loss_terms partitions the teachers by what their scores carry (the host field `place`
    writes: the settings' places of the grouped teachers), not by an entry's flag: the same batch
    gives the same loss whether or not the entry says ';tokenizer=own', and naming the other
    teacher as the grouped one (the negative control) swaps their weights."""
    batch, hidden, weight = _batch(repeats=False)
    flagged = _loss(batch, hidden, weight, per_part=False)
    flags_off = {**SETTINGS, "MEGATRON_RL_PATCHES_OPD_TEACHERS": "/s,/t"}
    student, tail = lm_head_topk_logprobs(hidden, weight, batch[keys.STEP_IDS][0],
                                          ids_mask=batch[keys.STEP_MASK][0])
    token = torch.zeros(R, dtype=torch.float64)
    unflagged = opd_terms.loss_terms(opd_settings(flags_off), batch, student, tail, token).sum()
    assert torch.equal(unflagged.detach(), flagged[0])
    swapped = opd_terms.loss_terms(opd_settings(flags_off), {**batch, keys.CROSS_TEACHERS: [torch.tensor([0])]},
                                      student, tail, token).sum()
    assert not torch.allclose(swapped.detach(), flagged[0])
