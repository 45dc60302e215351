"""A Megatron host's shared-prefix pass (`integrations/megatron/shared_prefix_pass.py`, slime's today):
off without the setting; a model the plan cannot run packs each sample whole with one warning; each
micro-batch's plan handed as its packed_seq_params and its figures summed for the pass's log line (a
padding sequence of one id on one row where the model computes its rows alike, else row by row); a
micro-batch a plan does not take (an id past the vocabulary, padding between a sample's rows) packed
whole and counted, decided from the micro-batch alone (every pipeline stage alike), never raised."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from kit.moe_statistics import constant_padding
from kit.shared_prefix import grpo_batch, trie_size

from megatron_rl_patches.integrations.megatron.shared_prefix_pass import prefix_pass
from megatron_rl_patches.shared_prefix.plan import shared_prefix_plan_of

pytestmark = pytest.mark.megatron
REPO = Path(__file__).resolve().parents[3]


def _model(**overrides):
    from megatron_rl_patches.testing.megatron_cpu import tiny_gpt_config
    from megatron_rl_patches.testing.packed_gpt import build_packed_gpt

    return build_packed_gpt(seq_length=256, seed=1, config=tiny_gpt_config(**overrides))


def test_the_pass_plans_each_micro_batch_and_sums_its_figures(megatron_cpu, caplog):
    model = _model()
    assert prefix_pass("a pass", [model], training=True, enabled=False) is None
    planned = prefix_pass("a pass", [model], training=True, enabled=True)
    assert planned is not None and planned.vocab == 64
    for seed in range(2):
        batch = grpo_batch(seed=seed)
        params = planned.params(batch.tokens, batch.thd_params(), batch.samples)
        assert shared_prefix_plan_of(params) is not None
    assert planned.figures["logical_tokens"] == 2 * sum(map(len, grpo_batch().sequences))
    physical = sum(trie_size(grpo_batch(seed=seed).sequences) for seed in range(2))  # each leading run once
    assert physical <= 2 * (40 + 5 + 9 + 3 + 12) and planned.figures["physical_tokens"] == physical
    with caplog.at_level(logging.INFO, logger="megatron_rl_patches"):
        planned.log()
    # issue 119 item 7: "2 groups of 6 samples" read as 12 samples; the figures are 6 samples in 2 groups
    assert (f"shared prefix: a pass computed {physical} tokens for 298 ({298 / physical:.2f}x fewer), 6 samples "
            "in 2 groups sharing a prefix, 2 alone") in caplog.text
    # padding: 4 rows of varying ids a micro-batch, each its own row; slime's, of one id, one row for this model
    assert planned.figures["padding_tokens"] == planned.figures["padding_rows"] == 2 * 4
    assert planned.repeated_padding_once  # rotary positions, no attention sink, no recurrent layer
    slime = constant_padding(((40, (5, 9)),), (), padding=6)
    plan = shared_prefix_plan_of(planned.params(slime.tokens, slime.thd_params(), slime.samples))
    assert plan is not None and (plan.stats.padding_tokens, plan.stats.padding_rows) == (6, 1)
    from megatron_rl_patches.testing.megatron_cpu import tiny_gpt_config
    from megatron_rl_patches.testing.packed_gpt import build_packed_gpt

    absolute = build_packed_gpt(seq_length=256, config=tiny_gpt_config(), position_embedding_type="learned_absolute")
    learned = prefix_pass("a pass", [absolute], training=True, enabled=True)
    assert learned is not None and not learned.repeated_padding_once  # each row reads its own position
    # docs/shared-prefix.md's line: one GRPO group of 8 (P = 1,024, R = 128), as the pass prints it
    planned.figures = {"logical_tokens": 9216, "physical_tokens": 2048, "groups": 1, "shared_samples": 8, "alone": 0}
    planned.what = "slime's training step"
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="megatron_rl_patches"):
        planned.log()
    (shown,) = [line for line in (REPO / "docs" / "shared-prefix.md").read_text().splitlines()
                if line.startswith("shared prefix: slime's training step computed")]
    assert caplog.messages == [shown] == ["shared prefix: slime's training step computed 2048 tokens for 9216 "
                                          "(4.50x fewer), 8 samples in 1 group sharing a prefix, 0 alone"]


def test_a_micro_batch_a_plan_does_not_take_is_packed_whole_and_counted(megatron_cpu, clean_patch_state, caplog):
    planned = prefix_pass("a pass", [_model()], training=False, enabled=True)
    far = grpo_batch(vocab=80, seed=3)
    given = far.thd_params()
    with caplog.at_level(logging.WARNING, logger="megatron_rl_patches"):
        assert planned.params(far.tokens, given, far.samples) is given
    assert "an id past the vocabulary" in caplog.text
    batch = grpo_batch()
    padded = batch.thd_params()
    padded.cu_seqlens_q_padded = padded.cu_seqlens_q + torch.arange(padded.cu_seqlens_q.numel(), dtype=torch.int32)
    assert planned.params(batch.tokens, padded, batch.samples) is padded
    negative = batch.tokens.clone()
    negative[0, 5] = -1  # the plan refuses it by name; the pass packs it whole, as an id past the vocabulary
    given = batch.thd_params()
    with caplog.at_level(logging.WARNING, logger="megatron_rl_patches"):
        assert planned.params(negative, given, batch.samples) is given
    assert "a negative id (-1)" in caplog.text
    assert planned.figures == {"packed_whole": 3}


def test_a_model_the_plan_cannot_run_packs_each_sample_whole_with_one_warning(megatron_cpu, clean_patch_state,
                                                                               caplog, moe_router_on_cpu):
    balanced = _model(num_moe_experts=4, moe_router_topk=2, moe_aux_loss_coeff=0.01, add_bias_linear=False,
                      moe_token_dispatcher_type="allgather", recompute_granularity="selective",
                      recompute_modules=["moe"])  # its router would run outside the layer's call: refused
    with caplog.at_level(logging.WARNING, logger="megatron_rl_patches"):
        assert prefix_pass("slime's training step", [balanced], training=True, enabled=True) is None
    assert "shared prefix: slime's training step runs each sample packed whole: MoE load balancing" in caplog.text
    assert prefix_pass("a teacher's pass", [balanced], training=False, enabled=True) is not None


def test_the_edges_of_what_is_packed_whole_and_the_words_said(megatron_cpu, clean_patch_state, caplog):
    """No model: a pass over a vocabulary of 64. An id of exactly 64 is packed whole, ids 0 and 63
    are planned; each warning said whole, naming the pass."""
    from megatron_rl_patches.integrations.megatron.shared_prefix_pass import PrefixPass

    batch = grpo_batch()
    step = PrefixPass("a scoring pass", vocab=64)
    edge = batch.tokens.clone()
    edge[0, 0], edge[0, 7] = 0, 63
    assert shared_prefix_plan_of(step.params(edge, batch.thd_params(), batch.samples)) is not None
    edge[0, 7] = 64
    given = batch.thd_params()
    padded = batch.thd_params()
    padded.cu_seqlens_q_padded = padded.cu_seqlens_q * 2
    with caplog.at_level(logging.WARNING, logger="megatron_rl_patches"):
        assert step.params(edge, given, batch.samples) is given
        assert step.params(batch.tokens, padded, batch.samples) is padded
    said = [record.getMessage() for record in caplog.records]
    assert said == [f"megatron-rl-patches: shared prefix: a scoring pass: a micro-batch with {reason} is packed whole "
                    "(counted in the pass's figures)" for reason in ("an id past the vocabulary (64 >= 64)",
                                                                     "padding between a sample's rows "
                                                                     "(cu_seqlens_q_padded)")]
    assert step.figures["packed_whole"] == 2


def test_each_plan_is_padded_to_the_pass_and_agreed_over_its_group(megatron_cpu, monkeypatch):
    """The stream padded to a multiple of the pass's `pad_to` (the tensor-parallel size), and the
    plan's fingerprint agreed over the pass's group (a recording stand-in around the real `agree`,
    called over no group: a stand-in group cannot exchange)."""
    from megatron_rl_patches.integrations.megatron import shared_prefix_pass
    from megatron_rl_patches.shared_prefix import plan_shared_prefix

    batch = grpo_batch()
    alone = plan_shared_prefix(batch.tokens, batch.cu_seqlens, samples=batch.samples)
    assert alone.physical_length % 4  # pad_to=4 changes the stream
    calls, real = [], shared_prefix_pass.agree

    def recorded(group, what, **kwargs):
        calls.append((group, what, kwargs))
        return real(None, what, **kwargs)

    monkeypatch.setattr(shared_prefix_pass, "agree", recorded)
    group = object()
    plan = shared_prefix_plan_of(shared_prefix_pass.PrefixPass("a pass", pad_to=4, group=group).params(
        batch.tokens, batch.thd_params(), batch.samples))
    want = plan_shared_prefix(batch.tokens, batch.cu_seqlens, samples=batch.samples, pad_to=4)
    assert plan.physical_length == want.physical_length and plan.physical_length % 4 == 0
    physical, logical, checksum = want.fingerprint()
    assert calls == [(group, "a micro-batch's shared-prefix plan",
                      {"match": {"physical rows": physical, "logical rows": logical, "checksum": checksum},
                       "where": "the tensor-parallel group"})]


def test_a_pass_plans_each_step_together_where_the_budget_cut_a_group(megatron_cpu, clean_patch_state, caplog):
    """`hold_steps` at a pass's door (issue 120): a group cut over three micro-batches is planned once per
    step, each micro-batch taking its step's plan by its index in the pass, its log-probs those of the same
    micro-batch packed whole; a step that cuts no group, and a model that cannot hold segments (one
    warning; raised under strict), keep the plan per micro-batch; ids other than the planned ones are
    refused by name."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_rl_patches.integrations.megatron.shared_prefix_step_pass import hold_steps, packed_micro_batch

    model = _model(hidden_dropout=0.0, attention_dropout=0.0)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 64, (30,), generator=gen)
    samples = [torch.cat([prompt, torch.randint(0, 64, (n,), generator=gen)]) for n in (3, 5, 4, 6)]
    samples.append(torch.randint(0, 64, (9,), generator=gen))
    cut = [packed_micro_batch([samples[i] for i in batch], 16) for batch in ([0, 1], [2], [3, 4])]
    whole = [packed_micro_batch(samples[:4], 4), packed_micro_batch(samples[4:], 4)]

    def params(batch):
        longest = int(batch.cu_seqlens.diff().max())
        cu = batch.cu_seqlens.int()
        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
                               max_seqlen_kv=longest)

    planned = prefix_pass("a pass", [model], training=False, enabled=True)
    assert planned is not None and hold_steps(planned, [model], training=False, steps=[cut, whole], first=3)
    assert sorted(planned.held) == [3, 4, 5]  # the cut step; the whole groups' step planned per micro-batch
    assert planned.figures["held_tokens"] == 30 and planned.figures["physical_tokens"] == 30 + 3 + 5 + 4 + 6 + 9
    # slime's padding (one repeated id) on one row each, as the plan per micro-batch lays it out for this model
    padding = [(plan.stats.padding_tokens, plan.stats.padding_rows) for _, plan in planned.held.values()]
    assert padding == [(12, 1), (14, 1), (3, 1)]
    with torch.no_grad():
        for index, batch in enumerate(cut):
            ids, plain = batch.tokens[None], params(batch)
            got = model(ids, None, None, packed_seq_params=planned.params(ids, plain, batch.samples, index=3 + index))
            want = model(ids, None, None, packed_seq_params=plain)
            rows = int(batch.cu_seqlens[batch.samples])
            assert float((got[:, :rows] - want[:, :rows]).abs().max()) <= 1e-5 * float(want.abs().max())
    with pytest.raises(RuntimeError, match="micro-batch 4 of the pass is not the one its step was planned from"):
        planned.params(cut[0].tokens[None], params(cut[0]), cut[0].samples, index=4)

    refused = prefix_pass("a step", [model], training=True, enabled=True)
    model.config.pipeline_model_parallel_size = 2  # what a held segment's deferred backward cannot run yet
    with caplog.at_level(logging.WARNING, logger="megatron_rl_patches"):
        assert refused is not None and not hold_steps(refused, [model], training=True, steps=[cut])
    assert refused.held == {} and ("shared prefix: a step: each micro-batch plans its own samples (a prompt the "
                                   "micro-batch budget cuts is computed again in each part): pipeline parallelism "
                                   "(pipeline_model_parallel_size=2)") in caplog.text
    with pytest.raises(ValueError, match=r"pipeline parallelism \(pipeline_model_parallel_size=2\).*; or unset "):
        hold_steps(refused, [model], training=True, steps=[cut], strict=True)
    model.config.pipeline_model_parallel_size = 1


def test_a_pass_that_replays_routes_plans_by_its_records(megatron_cpu, clean_patch_state, caplog):
    """`PrefixPass.records` (a host replaying MoE routes): each micro-batch's plan shares only the rows
    whose records agree; no records planned by the ids; records that are not the micro-batch's rows, or
    that the host cannot read (its words), packed whole and counted (`replayed_records`, one rank)."""
    from megatron_rl_patches.integrations.megatron.replayed_records import whole_records

    planned = prefix_pass("a pass", [_model()], training=True, enabled=True)
    batch = grpo_batch()
    tokens = batch.tokens.numel()
    records = [torch.zeros(tokens, 2, dtype=torch.int64), torch.zeros(tokens, 2, dtype=torch.int64)]
    by_ids = shared_prefix_plan_of(planned.params(batch.tokens, batch.thd_params(), batch.samples)).stats
    planned.records = lambda: records
    assert shared_prefix_plan_of(planned.params(batch.tokens, batch.thd_params(), batch.samples)).stats == by_ids
    records[1][int(batch.cu_seqlens[1]) + 3, 0] = 1  # the second sample's 4th token: it parts from its group there
    parted = shared_prefix_plan_of(planned.params(batch.tokens, batch.thd_params(), batch.samples)).stats
    assert parted.physical_tokens == by_ids.physical_tokens + 40 - 3
    planned.records = lambda: None
    assert shared_prefix_plan_of(planned.params(batch.tokens, batch.thd_params(), batch.samples)).stats == by_ids
    planned.records = lambda: (records[1][:, 0],)  # one layer's top-1, as a tuple
    assert shared_prefix_plan_of(planned.params(batch.tokens, batch.thd_params(), batch.samples)).stats == parted
    other = ("records of the replayed MoE routes that are not the micro-batch's rows on every tensor-parallel rank")
    for held, said in ((lambda: [records[0][1:]], other), (lambda: [], other), (lambda: [records[0], [0]], other),
                       (lambda: "the host cannot read them", "the host cannot read them")):
        planned.records = held
        with caplog.at_level(logging.WARNING, logger="megatron_rl_patches"):
            given = batch.thd_params()
            assert planned.params(batch.tokens, given, batch.samples) is given
        assert said in caplog.text
    assert planned.figures["packed_whole"] == 4
    alone = whole_records(records, tokens, None)  # one rank: its own records, as they are
    assert len(alone) == 2 and all(torch.equal(a, b) for a, b in zip(alone, records))
