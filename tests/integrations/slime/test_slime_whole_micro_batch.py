"""Shared-prefix packing at context parallelism through slime's `get_batch` (624b824a): the whole
micro-batch rebuilt from what the batch keeps (`unconcat_tokens`, the global `cu_seqlens_q`) is the
stream whose zigzag cut (slime's default: each sample padded with id 0 to a multiple of 2 · cp, the
local stream padded, its sequence times cp) or contiguous cut (`--allgather-cp`: the stream padded
to a multiple of cp · pad size) is every rank's ids, at odd lengths and with padding; the pass
plans it, each rank's share of the plan's logical ids is its own ids, and a rank whose ids are not
the cut packs the micro-batch whole with a warning."""
from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from megatron_rl_patches.integrations.megatron.shared_prefix_pass import ContextCut, PrefixPass, cut_reason
from megatron_rl_patches.integrations.slime.whole_micro_batch import whole_micro_batch

PAD = 8  # slime's pad size (tensor-parallel size x pad_multiplier; 128 in jobs)


def _samples(seed: int = 0) -> list[torch.Tensor]:
    """A group of three sharing a 13-token prompt (odd lengths), and one alone."""
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(1, 64, (13,), generator=gen)
    group = [torch.cat([prompt, torch.randint(1, 64, (n,), generator=gen)]) for n in (5, 2, 9)]
    return [*group, torch.randint(1, 64, (7,), generator=gen)]


def _slime_batch(samples: list[torch.Tensor], cp: int, rank: int, allgather: bool) -> dict:
    """The batch slime's get_batch hands rank `rank` of `cp` (its cut written out from slime's code)."""
    if allgather:
        cu = [0, *torch.tensor([s.numel() for s in samples]).cumsum(0).tolist()]
        stream = torch.cat(samples)
        pad = -stream.numel() % (cp * PAD)
        if pad:
            stream, cu = F.pad(stream, (0, pad)), [*cu, cu[-1] + pad]
        tokens, bounds = stream.chunk(cp)[rank], torch.tensor(cu, dtype=torch.int32)
    else:
        pieces = []
        for sample in samples:
            chunk = -(-sample.numel() // (2 * cp))
            padded = F.pad(sample, (0, 2 * cp * chunk - sample.numel()))
            mirror = 2 * cp - 1 - rank
            pieces.append(torch.cat([padded[rank * chunk:(rank + 1) * chunk],
                                     padded[mirror * chunk:(mirror + 1) * chunk]]))
        cu = [0, *torch.tensor([p.numel() for p in pieces]).cumsum(0).tolist()]
        tokens = torch.cat(pieces)
        pad = -tokens.numel() % PAD
        if pad:
            tokens, cu = F.pad(tokens, (0, pad)), [*cu, cu[-1] + pad]
        bounds = torch.tensor(cu, dtype=torch.int32) * cp
    params = SimpleNamespace(cu_seqlens_q=bounds, cu_seqlens_kv=bounds, qkv_format="thd")
    return {"tokens": tokens[None], "unconcat_tokens": samples, "packed_seq_params": params}


@pytest.mark.parametrize("allgather", [False, True], ids=["zigzag", "allgather"])
@pytest.mark.parametrize("cp", [2, 3])
def test_the_rebuilt_micro_batch_is_the_stream_slime_cut(cp, allgather):
    samples = _samples()
    layout = "contiguous" if allgather else "zigzag"
    wholes = []
    for rank in range(cp):
        batch = _slime_batch(samples, cp, rank, allgather)
        whole = whole_micro_batch(batch)
        assert cut_reason(whole, batch["tokens"], batch["packed_seq_params"], ContextCut(cp, rank, layout)) is None
        wholes.append(whole)
    assert all(torch.equal(w, wholes[0]) for w in wholes)  # every rank rebuilds the same stream
    whole, at = wholes[0], 0
    for sample in samples:  # each sample in order, then id 0 only (each sample's and the stream's padding)
        assert torch.equal(whole[at:at + sample.numel()], sample)
        at += sample.numel()
        if not allgather:
            at += -sample.numel() % (2 * cp)
    assert not whole[at:].any() and (whole.numel() > at or cp == 3)  # a tail of padding but at cp=3 zigzag
    other = "zigzag" if allgather else "contiguous"  # the other layout's cut is not these ids
    batch = _slime_batch(samples, cp, 0, allgather)
    assert cut_reason(whole, batch["tokens"], batch["packed_seq_params"], ContextCut(cp, 0, other)) is not None


def test_what_the_batch_does_not_say_is_not_rebuilt():
    batch = _slime_batch(_samples(), 2, 0, False)
    assert whole_micro_batch({**batch, "unconcat_tokens": []}) is None
    longer = [torch.cat([s, s]) for s in batch["unconcat_tokens"]]  # a sample longer than its sequence
    assert whole_micro_batch({**batch, "unconcat_tokens": longer}) is None
    fewer = SimpleNamespace(cu_seqlens_q=batch["packed_seq_params"].cu_seqlens_q[:3])
    assert whole_micro_batch({**batch, "packed_seq_params": fewer}) is None


@pytest.mark.megatron
@pytest.mark.parametrize("allgather", [False, True], ids=["zigzag", "allgather"])
def test_each_rank_plans_the_whole_micro_batch_and_holds_its_own_ids(allgather):
    from megatron_rl_patches.shared_prefix.context_parallel import share_of, taken
    from megatron_rl_patches.shared_prefix.plan import shared_prefix_plan_of

    samples, layout = _samples(), "contiguous" if allgather else "zigzag"
    for rank in range(2):
        batch = _slime_batch(samples, 2, rank, allgather)
        step = PrefixPass("a pass", pad_to=4, vocab=64, cut=ContextCut(2, rank, layout), repeated_padding_once=True)
        params = step.params(batch["tokens"], batch["packed_seq_params"], len(samples), whole_micro_batch(batch))
        plan = shared_prefix_plan_of(params)
        assert plan is not None and params.cp_layout == layout and plan.physical_length % 4 == 0
        mine = taken(plan, share_of(plan, 2, rank, layout), "logical_tokens", "logical", "cpu")
        assert torch.equal(mine, batch["tokens"][0])
        padding = 0 if allgather else 2 + 1 + 2 + 1  # slime pads each sample to a multiple of 2 · cp
        assert step.figures["physical_tokens"] == 13 + 5 + 2 + 9 + 7 + padding
        assert step.figures["padding_tokens"] > step.figures["padding_rows"] == 1  # slime's id 0 after the samples


@pytest.mark.megatron
def test_a_share_that_is_not_the_cut_is_packed_whole_with_a_warning(caplog, clean_patch_state):
    batch = _slime_batch(_samples(), 2, 1, False)
    tampered = batch["tokens"].clone()
    tampered[0, 3] += 1
    step = PrefixPass("slime's training step", pad_to=4, vocab=64, cut=ContextCut(2, 1, "zigzag"))
    given = batch["packed_seq_params"]
    with caplog.at_level(logging.WARNING, logger="megatron_rl_patches"):
        assert step.params(tampered, given, 4, whole_micro_batch(batch)) is given
        assert step.params(batch["tokens"], given, 4, None) is given
    assert "context-parallel rank 1's ids that are not its zigzag cut of the whole micro-batch" in caplog.text
    assert "no whole micro-batch from the host" in caplog.text
    assert step.figures == {"packed_whole": 2}


@pytest.mark.megatron
def test_the_outcome_is_agreed_over_the_group_and_another_ranks_failure_packs_whole_here(monkeypatch, caplog,
                                                                                        clean_patch_state):
    """Each rank's check agreed over the pass's group (the TP x CP ranks; a recording stand-in for
    the real exchange, over no group): where another rank's share is not its cut, this rank packs
    whole too; else the plan's fingerprint and cp_layout agreed."""
    from megatron_rl_patches.integrations.megatron import shared_prefix_pass

    flags, plans, others = [], [], [1]
    monkeypatch.setattr(shared_prefix_pass, "agreed_min", lambda group, value: flags.append((group, value)) or
                        min(value, others[0]))
    monkeypatch.setattr(shared_prefix_pass, "agree", lambda group, what, **kwargs: plans.append((group, kwargs)))
    group, batch = object(), _slime_batch(_samples(), 2, 0, True)
    step = PrefixPass("a pass", pad_to=4, group=group, vocab=64, cut=ContextCut(2, 0, "contiguous"))
    given = batch["packed_seq_params"]
    assert step.params(batch["tokens"], given, 4, whole_micro_batch(batch)) is not given
    assert flags == [(group, 1)] and plans[0][0] is group and plans[0][1]["match"]["cp_layout"] == "contiguous"
    others[0] = 0  # another rank of the group failed its check
    with caplog.at_level(logging.WARNING, logger="megatron_rl_patches"):
        assert step.params(batch["tokens"], given, 4, whole_micro_batch(batch)) is given
    assert flags[-1] == (group, 1) and len(plans) == 1 and step.figures["packed_whole"] == 1
    assert "another context-parallel or tensor-parallel rank's share" in caplog.text
