"""A step's micro-batches planned together (`plan_shared_prefix_step`) on a real megatron-core
GPTModel on CPU: a group's prompt (and a multi-turn tree's shared turns) cut over several
micro-batches is computed once per step, held, and backpropagated once, in its last reader's
backward. Against each micro-batch packed whole (megatron-core's `thd` packing): the log-probs,
entropy and every gradient of the step within 1e-6 / 2e-6 in float32 and 1e-12 in float64; the
embedding handed only the rows each pass computes; nothing held after the step. Through
megatron-core's own schedule with DDP's overlapped gradient reduce and the distributed optimizer,
with and without full activation recompute, over steps of different shapes (the last micro-batch
owning a held segment, owning none, one micro-batch alone): every bucket's reduce starts on the
gradient the packed path reduces (the deferred backward lands before it)."""
from __future__ import annotations

import pytest
import torch
from kit.shared_prefix import TokenCount, objective, ordinary, scores, step_batches, tree_batch

from megatron_rl_patches.testing.compare import collect_grads, grad_error, relative_error

pytestmark = pytest.mark.megatron
TOL = {torch.float32: 1e-6, torch.float64: 1e-12}
GRAD_TOL = {torch.float32: 2e-6, torch.float64: 1e-12}


def _draw(n: int, seed: int) -> list[int]:
    return torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _group_samples() -> list[list[int]]:
    prompt = _draw(40, 1)
    return [prompt + _draw(n, 10 + n) for n in (5, 9, 3, 7, 6, 4)] + [_draw(11, 99)]


def _tree_samples() -> list[list[int]]:
    return tree_batch(system=24, turns=((6, 8, 2), (5, 7, 3)), per_turn=True, padding=0, seed=7).sequences


SCENARIOS = {  # name: (samples, the indices each micro-batch packs)
    "group-over-3": (_group_samples, [[0, 1], [2, 3, 6], [4, 5]]),
    "last-owns-nothing": (_group_samples, [[0, 1, 2], [3, 4, 5], [6]]),
    "tree-over-3": (_tree_samples, [[0, 3, 6], [1, 4, 7], [2, 5]]),
}


def _model(dtype=torch.float32, **overrides):
    from megatron_rl_patches.shared_prefix import prepare_shared_prefix
    from megatron_rl_patches.testing.megatron_cpu import tiny_gpt_config
    from megatron_rl_patches.testing.packed_gpt import build_packed_gpt

    config = tiny_gpt_config(num_query_groups=2, params_dtype=dtype, pipeline_dtype=dtype, **overrides)
    return prepare_shared_prefix(build_packed_gpt(seq_length=512, seed=3, config=config).to(dtype))


def _step(batches, **kwargs):
    from megatron_rl_patches.shared_prefix import plan_shared_prefix_step

    return plan_shared_prefix_step([(b.tokens, b.cu_seqlens) for b in batches], samples=[b.samples for b in batches],
                                   **kwargs)


def _held(model, batch, plan):
    from megatron_rl_patches.shared_prefix import shared_prefix_params

    return model(batch.tokens, None, None, packed_seq_params=shared_prefix_params(plan))


def _trained(model, batches, route):
    """(log-probs, entropy) per micro-batch and the step's gradients, each micro-batch's objective
    backpropagated before the next micro-batch's forward (as a schedule without pipelining runs)."""
    out = []
    for index, (batch, one) in enumerate(zip(batches, route)):
        log_probs, entropy = scores(one(model, batch), batch)
        objective(log_probs, entropy, seed=index).backward()
        out.append((log_probs.detach(), entropy.detach()))
    return out, collect_grads(model)


@pytest.mark.parametrize(("name", "dtype"), [(n, torch.float32) for n in SCENARIOS] + [("tree-over-3", torch.float64)])
def test_a_step_holding_segments_equals_each_micro_batch_packed_whole(megatron_cpu, name, dtype):
    samples, cuts = SCENARIOS[name]
    sequences = samples()
    batches = step_batches(sequences, cuts)
    model = _model(dtype)
    want, want_grads = _trained(model, batches, [ordinary] * len(batches))
    step = _step(batches)
    count = TokenCount(model)
    got, grads = _trained(model, batches, [lambda m, b, p=p: _held(m, b, p) for p in step.plans])
    count.close()
    for (lp, ent), (want_lp, want_ent) in zip(got, want):
        assert relative_error(lp, want_lp) < TOL[dtype] and relative_error(ent, want_ent) < TOL[dtype]
    assert grad_error(grads, want_grads) < GRAD_TOL[dtype]
    assert not step.store.values  # every held segment released by its owner's backward
    # the step's trie once: each distinct leading-token sequence computed once, in a side pass or its own rows
    trie = {tuple(s[:k + 1]) for s in sequences for k in range(len(s))}
    assert step.stats.computed_tokens == len(trie)
    assert sum(count.seen) == len(trie) + step.stats.recomputed_tokens + sum(p.padding_rows for p in step.plans)


def _long_samples() -> list[list[int]]:
    prompt = _draw(30, 2)
    return [_draw(150, 3), _draw(9, 4), prompt + _draw(20, 5), prompt + _draw(12, 6), prompt + _draw(25, 7)]


@pytest.mark.parametrize(("cuts", "budget"), [([[0, 1], [2, 3, 4]], 50), ([[1, 2], [0, 3, 4]], 40)],
                         ids=["long-then-group", "group-cut-long-inside"])
def test_a_budget_bounds_every_forward_and_a_long_sample_trains_in_chunks(megatron_cpu, cuts, budget):
    sequences = _long_samples()  # one sample 3x the budget and more, a group whose prompt and members exceed it
    batches = step_batches(sequences, cuts)
    model = _model()
    want, want_grads = _trained(model, batches, [ordinary] * len(batches))
    step = _step(batches, max_tokens=budget)
    count = TokenCount(model)
    got, grads = _trained(model, batches, [lambda m, b, p=p: _held(m, b, p) for p in step.plans])
    count.close()
    for (lp, ent), (want_lp, want_ent) in zip(got, want):
        assert relative_error(lp, want_lp) < TOL[torch.float32] and relative_error(ent, want_ent) < TOL[torch.float32]
    assert grad_error(grads, want_grads) < GRAD_TOL[torch.float32]
    assert max(count.seen) <= budget and len(count.seen) > len(batches)  # every forward within the budget
    assert not step.store.values


def test_a_forward_only_pass_holds_without_gradients(megatron_cpu):
    batches = step_batches(*(lambda s, c: (s(), c))(*SCENARIOS["tree-over-3"]))
    model = _model()
    step = _step(batches)
    with torch.no_grad():
        want = [scores(ordinary(model, b), b) for b in batches]
        got = [scores(_held(model, b, p), b) for b, p in zip(batches, step.plans)]
    for (lp, ent), (want_lp, want_ent) in zip(got, want):
        assert relative_error(lp, want_lp) < TOL[torch.float32] and relative_error(ent, want_ent) < TOL[torch.float32]
    assert not step.store.values


def _schedule_steps(held: bool, recompute: bool, steps: list) -> list:
    """Each step's micro-batches through megatron-core's schedule on a DDP model (overlapped
    gradient reduce, distributed optimizer): per step, every bucket's gradient when its reduce
    started and after the step."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_rl_patches.shared_prefix import prepare_shared_prefix
    from megatron_rl_patches.testing.megatron_cpu import tiny_gpt_config, wrap_ddp
    from megatron_rl_patches.testing.packed_gpt import build_packed_gpt

    extra = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1) if recompute else {}
    config = tiny_gpt_config(num_query_groups=2, **extra)
    ddp = wrap_ddp(build_packed_gpt(seq_length=512, seed=3, config=config), overlap_grad_reduce=True,
                   use_distributed_optimizer=True, bucket_size=2000)
    config.no_sync_func, config.finalize_model_grads_func = ddp.no_sync, None
    prepare_shared_prefix(ddp)
    started: list = []
    for group in ddp.bucket_groups:  # what each bucket's reduce starts from
        def start(*args, _start=group.start_grad_sync, _group=group, **kwargs):
            started.append([bucket.grad_data.clone() for bucket in _group.buckets])
            return _start(*args, **kwargs)
        group.start_grad_sync = start
    out = []
    for batches in steps:
        plans = _step(batches).plans if held else [None] * len(batches)

        def forward_step(iterator, model):
            batch, plan = next(iterator)
            output = ordinary(model, batch) if plan is None else _held(model, batch, plan)

            def loss(logits):
                value = objective(*scores(logits, batch))
                return value, {"objective": value.detach()}

            return output, loss

        ddp.zero_grad_buffer()
        started.clear()
        get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(list(zip(batches, plans))),
                                    model=[ddp], num_microbatches=len(batches), seq_length=64, micro_batch_size=1,
                                    forward_only=False)
        ddp.finish_grad_sync()
        out.append((sorted(started, key=lambda b: float(b[0].abs().sum())),
                    [bucket.grad_data.clone() for buffer in ddp.buffers for bucket in buffer.buckets]))
    return out


@pytest.mark.parametrize("recompute", [False, True], ids=["no-recompute", "full-recompute"])
def test_through_megatron_cores_schedule_every_reduce_starts_on_the_whole_gradient(megatron_cpu, recompute):
    from megatron_rl_patches.shared_prefix import check_shared_prefix_step
    from megatron_rl_patches.shared_prefix.kinds.latent_attention import megatron_core_before_0_16

    if recompute and megatron_core_before_0_16():
        model = _model(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
        with pytest.raises(ValueError, match=r"full activation recompute on megatron-core 0\.1[345]"):
            check_shared_prefix_step(model, training=True)
        pytest.skip("megatron-core before 0.16 refuses a step under full recompute by name (checked above)")
    group, tree = _group_samples(), _tree_samples()
    steps = [step_batches(group, SCENARIOS["group-over-3"][1]), step_batches(group, [[0, 1, 2, 3, 4, 5, 6]]),
             step_batches(group, SCENARIOS["last-owns-nothing"][1]), step_batches(tree, SCENARIOS["tree-over-3"][1])]
    want = _schedule_steps(False, recompute, steps)
    got = _schedule_steps(True, recompute, steps)
    for (want_started, want_grads), (got_started, got_grads) in zip(want, got):
        assert len(got_started) == len(want_started) > 0
        for got_buckets, want_buckets in zip(got_started, want_started):
            assert all(relative_error(g, w) < GRAD_TOL[torch.float32] for g, w in zip(got_buckets, want_buckets))
        assert all(relative_error(g, w) < GRAD_TOL[torch.float32] for g, w in zip(got_grads, want_grads))


@pytest.mark.parametrize("statistic", ["aux-loss", "seq-aux-loss", "global-aux-loss", "z-loss", "expert-bias"])
def test_moe_statistics_count_a_held_segments_rows_in_every_micro_batch_that_reads_them(
        megatron_cpu, moe_router_on_cpu, statistic):
    from kit.moe_statistics import STATISTICS, read_statistics, reset_statistics
    from megatron.core.transformer.moe.router import TopKRouter

    from megatron_rl_patches.shared_prefix import prepare_shared_prefix
    from megatron_rl_patches.testing.moe_gpt import tiny_moe_config
    from megatron_rl_patches.testing.packed_gpt import build_packed_gpt

    if statistic == "global-aux-loss" and not hasattr(TopKRouter, "reset_global_aux_loss_tracker"):
        pytest.skip("this megatron-core has no global_aux_loss (0.13)")
    batches = step_batches(_group_samples(), SCENARIOS["group-over-3"][1])  # padding of varying ids
    model = prepare_shared_prefix(build_packed_gpt(seq_length=512, seed=5,
                                                   config=tiny_moe_config(**STATISTICS[statistic])))
    results = []
    for route in ([ordinary] * len(batches), [lambda m, b, p=p: _held(m, b, p) for p in _step(batches).plans]):
        before = reset_statistics(model)
        model.train()
        scored, grads = _trained(model, batches, route)
        results.append((scored, grads, read_statistics(model, before)))
    (want, want_grads, want_stats), (got, grads, stats) = results
    assert all(relative_error(g[0], w[0]) < TOL[torch.float32] for g, w in zip(got, want))
    assert grad_error(grads, want_grads) < GRAD_TOL[torch.float32]
    assert sorted(stats["losses"]) == sorted(want_stats["losses"])
    for name, values in want_stats["losses"].items():
        assert relative_error(stats["losses"][name], values) < TOL[torch.float32], name
    assert all(torch.equal(c, w) for c, w in zip(stats["counts"], want_stats["counts"]))
    assert all(torch.equal(b, w) for b, w in zip(stats["bias"], want_stats["bias"]))
    if statistic == "expert-bias":
        assert int(sum(c.sum() for c in want_stats["counts"])) == 2 * 2 * sum(b.tokens.numel() for b in batches)
    else:
        assert any(v.abs().sum() > 0 for v in want_stats["losses"].values())


def _each_alone(model, batch):
    """Logits [1, rows, V] of the sample rows, each sample run on its own (no packing)."""
    bounds = batch.cu_seqlens.tolist()
    return torch.cat([model(batch.tokens[:, a:b], torch.arange(b - a)[None], None)
                      for a, b in zip(bounds[:batch.samples], bounds[1:batch.samples + 1])], dim=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_gated_delta_nets_continue_a_held_segments_state_and_window(megatron_cpu, dtype):
    """megatron-core's GatedDeltaNet (3 of 4 layers): a prompt of 70 rows (across its 64-row chunk)
    and one of 2 (shorter than the 3-row window) cut over micro-batches, a sample 2.5x the budget in
    chunks: against each sample run alone (megatron-core's GatedDeltaNet refuses packed input)."""
    from megatron_rl_patches.shared_prefix import prepare_shared_prefix
    from megatron_rl_patches.testing.gdn_gpt import (
        build_gated_delta_net_gpt,
        gated_delta_net_on_cpu,
        megatron_gated_delta_net_served,
        sequential_gated_delta_rule,
        tiny_gated_delta_net_config,
    )

    if not megatron_gated_delta_net_served():
        pytest.skip("megatron-core's GatedDeltaNet is not 0.16's megatron.core.ssm.gated_delta_net")
    long, short = _draw(70 if dtype == torch.float32 else 20, 8), _draw(2, 9)
    sequences = [long + _draw(n, 20 + n) for n in (5, 1, 3)] + [short + _draw(n, 30 + n) for n in (6, 4)]
    sequences.append(_draw(50, 40))
    batches = step_batches(sequences, [[0, 3], [1, 4, 5], [2]], padding=0)
    with gated_delta_net_on_cpu(sequential_gated_delta_rule if dtype == torch.float64 else None):
        config = tiny_gated_delta_net_config(params_dtype=dtype, pipeline_dtype=dtype)
        model = prepare_shared_prefix(build_gated_delta_net_gpt(config, seed=4).to(dtype))
        want, want_grads = _trained(model, batches, [_each_alone] * len(batches))
        step = _step(batches, max_tokens=20 if dtype == torch.float64 else 40)
        got, grads = _trained(model, batches, [lambda m, b, p=p: _held(m, b, p) for p in step.plans])
    assert all(relative_error(g[0], w[0]) < GRAD_TOL[dtype] for g, w in zip(got, want))
    floor = GRAD_TOL[dtype] if dtype == torch.float32 else 1e-7  # megatron-core's float32 casts of alpha and gate
    assert grad_error(grads, want_grads) < floor
    assert step.stats.held_tokens > len(long) and not step.store.values


@pytest.mark.parametrize(("rope_type", "dtype"), [("yarn", torch.float32), ("rope", torch.float64)])
def test_multi_latent_attention_reads_a_held_segments_keys_at_their_own_positions(megatron_cpu, rope_type, dtype):
    from kit.latent_gpt import build_mla_gpt, mla_takes_packed_input, tiny_mla_config

    from megatron_rl_patches.shared_prefix import prepare_shared_prefix

    if not mla_takes_packed_input():
        pytest.skip("this megatron-core's MLA does not run packed input on CPU (0.13)")
    batches = step_batches(_group_samples(), SCENARIOS["group-over-3"][1])
    model = prepare_shared_prefix(build_mla_gpt(tiny_mla_config(rope_type, dtype)))
    want, want_grads = _trained(model, batches, [ordinary] * len(batches))
    step = _step(batches, max_tokens=30)
    got, grads = _trained(model, batches, [lambda m, b, p=p: _held(m, b, p) for p in step.plans])
    assert all(relative_error(g[0], w[0]) < TOL[dtype] for g, w in zip(got, want))
    assert grad_error(grads, want_grads) < GRAD_TOL[dtype]
    assert any("linear_kv_down_proj" in name for name in grads) and not step.store.values


@pytest.mark.parametrize(("field", "value", "words", "training"), [
    ("pipeline_model_parallel_size", 2, "pipeline parallelism (pipeline_model_parallel_size=2)", False),
    ("attention_dropout", 0.1, "dropout in training (attention_dropout=0.1)", True),
    ("hidden_dropout", 0.1, "dropout in training (hidden_dropout=0.1)", True),
])
def test_what_held_segments_cannot_run_is_refused_by_name_before_the_pass(megatron_cpu, field, value, words,
                                                                        training):
    from megatron_rl_patches.shared_prefix import check_shared_prefix_step, shared_prefix_step_reason

    model = _model(hidden_dropout=0.0, attention_dropout=0.0)
    assert shared_prefix_step_reason(model, training=True) is None
    setattr(model.config, field, value)
    if training:  # dropout only draws in training: a forward-only pass holds segments
        assert shared_prefix_step_reason(model, training=False) is None
    with pytest.raises(ValueError, match=r"segments held across a step's micro-batches cannot run this model: "
                                         + words.replace("(", r"\(").replace(")", r"\)")):
        check_shared_prefix_step(model, training=training)


def test_a_kind_that_cannot_hand_a_segment_on_refuses_a_step_by_its_own_words(megatron_cpu):
    """An MTP model: the multi-token-prediction kind's `Continuation.held_reason`, named with the
    module's class, on every rank (one rank here), before the pass; a dense model of the same config
    without its depths holds segments."""
    from megatron_rl_patches.shared_prefix import check_shared_prefix_step, prepare_shared_prefix
    from megatron_rl_patches.testing.mtp_gpt import build_tiny_mtp_gpt, tiny_mtp_config

    model = prepare_shared_prefix(build_tiny_mtp_gpt(tiny_mtp_config(mtp_num_layers=1)))
    with pytest.raises(ValueError, match=r"cannot run this model: MTP: its depths' streams hold no segment yet "
                                         r"\(megatron\.core\.transformer\.multi_token_prediction\."
                                         r"MultiTokenPredictionBlock\)"):
        check_shared_prefix_step(model, training=False)
