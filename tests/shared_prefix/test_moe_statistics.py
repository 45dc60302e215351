"""MoE routing statistics in training under a shared-prefix plan against the same samples packed
whole, on a real megatron-core MoE GPTModel: each of `aux_loss`, `seq_aux_loss`, `global_aux_loss`,
the z-loss, expert-bias updates and Sinkhorn routing — the losses megatron-core logs per layer, the
tokens-per-expert counts, the expert bias after megatron's own update, log-probs (1e-6) and every
gradient (2e-6, float32), the statistics' own gradients in the router included. A shared prefix
token counts once per sample that holds it; a padding row counts by its own id, as packed."""
from __future__ import annotations

import pytest
import torch
from kit.moe_statistics import STATISTICS, constant_padding, statistics_pass, varying_padding
from kit.shared_prefix import ordinary, planned

from megatron_rl_patches.testing import layouts
from megatron_rl_patches.testing.compare import grad_error, relative_error

pytestmark = pytest.mark.megatron
TOL, GRAD_TOL = 1e-6, 2e-6


def _model(**statistics):
    from megatron_rl_patches.testing.moe_gpt import tiny_moe_config
    from megatron_rl_patches.testing.packed_gpt import build_packed_gpt

    return build_packed_gpt(seq_length=512, seed=5, config=tiny_moe_config(**statistics))


def _agree(got: dict, want: dict) -> None:
    assert relative_error(got["log_probs"], want["log_probs"]) < TOL
    assert grad_error(got["grads"], want["grads"]) < GRAD_TOL
    assert sorted(got["losses"]) == sorted(want["losses"])
    for name, values in want["losses"].items():
        assert relative_error(got["losses"][name], values) < TOL, name
    assert len(got["counts"]) == len(want["counts"])
    for counts, wanted in zip(got["counts"], want["counts"]):
        assert torch.equal(counts, wanted)
    for bias, wanted in zip(got["bias"], want["bias"]):
        assert torch.equal(bias, wanted)


@layouts.mark("moe")
@pytest.mark.parametrize("statistic", sorted(STATISTICS))
def test_each_statistic_counts_a_shared_token_once_per_sample(megatron_cpu, moe_router_on_cpu, statistic):
    batch = constant_padding(((30, (5, 9, 3)), (10, (4, 6))), (7,), padding=5)
    from megatron.core.transformer.moe.router import TopKRouter

    if statistic == "global-aux-loss" and not hasattr(TopKRouter, "reset_global_aux_loss_tracker"):
        pytest.skip("this megatron-core has no global_aux_loss (0.13)")
    model = _model(**STATISTICS[statistic])
    from megatron_rl_patches.shared_prefix import repeated_padding_alike

    assert repeated_padding_alike(model)  # rotary positions, no sink, no recurrent layer: one row for the padding
    want = statistics_pass(model, batch, ordinary)
    got = statistics_pass(model, batch, lambda m, b: planned(m, b, pad_to=4, repeated_padding_once=True))
    _agree(got, want)
    assert batch.plan(pad_to=4, repeated_padding_once=True).stats.padding_rows == 1  # and 2 rows no row reads
    if statistic in ("aux-loss", "seq-aux-loss", "global-aux-loss", "z-loss"):
        assert any(v.abs().sum() > 0 for v in want["losses"].values())
    if statistic == "expert-bias":
        assert int(sum(c.sum() for c in want["counts"])) == 2 * 2 * batch.tokens.numel()  # 2 layers, top-2
        assert not torch.equal(want["bias"][0], torch.zeros_like(want["bias"][0]))


@layouts.mark("moe")
@pytest.mark.parametrize("statistic", sorted(STATISTICS))
def test_each_statistic_counts_each_padding_row_by_its_own_id(megatron_cpu, moe_router_on_cpu, statistic):
    """Two padding sequences of varying ids (megatron-core's packed path computes each row by its own
    id, at its own position, and counts it): every statistic, the counts, the bias and, under
    Sinkhorn's balancing over the batch, the samples' own log-probs equal the packed path's."""
    batch = varying_padding(((30, (5, 9, 3)), (10, (4, 6))), (7,), paddings=(5, 4))
    from megatron.core.transformer.moe.router import TopKRouter

    if statistic == "global-aux-loss" and not hasattr(TopKRouter, "reset_global_aux_loss_tracker"):
        pytest.skip("this megatron-core has no global_aux_loss (0.13)")
    model = _model(**STATISTICS[statistic])
    want = statistics_pass(model, batch, ordinary)
    got = statistics_pass(model, batch, lambda m, b: planned(m, b, pad_to=4, repeated_padding_once=True))
    _agree(got, want)  # varying ids: row by row, repeated_padding_once or not
    assert batch.plan(pad_to=4, repeated_padding_once=True).stats.padding_rows == 9


def test_repeated_padding_once_only_where_the_rows_of_one_id_are_alike(megatron_cpu, moe_router_on_cpu):
    """Learned absolute positions: each row of a run of one padding id reads its own position, so the
    packed path's rows differ. `repeated_padding_alike` says no; computed row by row the statistics are
    exact; forced onto one row (the negative control) the aux loss and the counts differ."""
    from megatron_rl_patches.shared_prefix import repeated_padding_alike
    from megatron_rl_patches.testing.moe_gpt import tiny_moe_config
    from megatron_rl_patches.testing.packed_gpt import build_packed_gpt

    statistics = {**STATISTICS["aux-loss"], **STATISTICS["expert-bias"]}
    model = build_packed_gpt(seq_length=512, seed=5, config=tiny_moe_config(**statistics),
                             position_embedding_type="learned_absolute")
    assert not repeated_padding_alike(model)
    batch = constant_padding(((30, (5, 9, 3)),), (7,), padding=6)
    want = statistics_pass(model, batch, ordinary)
    _agree(statistics_pass(model, batch, lambda m, b: planned(m, b, pad_to=4)), want)
    forced = statistics_pass(model, batch, lambda m, b: planned(m, b, pad_to=4, repeated_padding_once=True))
    assert relative_error(forced["losses"]["load_balancing_loss"], want["losses"]["load_balancing_loss"]) > 1e-5
    assert not all(torch.equal(g, w) for g, w in zip(forced["counts"], want["counts"]))


def test_the_negative_control_physical_rows_counted_once_differ(megatron_cpu, moe_router_on_cpu, monkeypatch):
    """The same pass with the layer's call never handing the router its plan: counts and loss differ."""
    from megatron_rl_patches.shared_prefix import moe_statistics

    batch = constant_padding(((30, (5, 9, 3)),), (7,), padding=2)
    model = _model(**STATISTICS["aux-loss"], moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid")
    want = statistics_pass(model, batch, ordinary)
    monkeypatch.setattr(moe_statistics, "plan_for_the_call", lambda *args: None)  # before the model is prepared
    got = statistics_pass(model, batch, planned)
    assert relative_error(got["log_probs"], want["log_probs"]) < TOL  # routing itself is per token
    assert not all(torch.equal(g, w) for g, w in zip(got["counts"], want["counts"]))
    assert relative_error(got["losses"]["load_balancing_loss"], want["losses"]["load_balancing_loss"]) > 1e-4


def test_the_plan_never_outlives_the_layer_call(megatron_cpu, moe_router_on_cpu):
    from megatron_rl_patches.shared_prefix import moe_statistics

    batch = constant_padding(((30, (5, 3)),), (), padding=0)
    model = _model(**STATISTICS["z-loss"])
    routers = [layer.mlp.router for layer in model.decoder.layers]
    seen = []
    model.decoder.layers[0].mlp.register_forward_pre_hook(  # the router holds the call's plan while it runs
        lambda module, args: seen.append(moe_statistics.layer_params(module.router)))
    statistics_pass(model, batch, planned)
    assert seen and all(moe_statistics.shared_prefix_plan_of(params) is not None for params in seen)
    assert all(moe_statistics.layer_params(router) is None for router in routers)
    layer = model.decoder.layers[0]
    layer.mlp.router.gating = None  # the call raises inside the layer: the router's plan is taken back all the same
    with pytest.raises(TypeError):
        planned(model, batch)
    assert all(moe_statistics.layer_params(router) is None for router in routers)


RECOMPUTED_ALONE = ("shared prefix: MoE routing statistics in training with the MLP / MoE module recomputed on its own "
                    "(recompute_modules 'mlp' / 'moe') are not taken with a shared-prefix plan; recompute whole layers "
                    "(recompute_granularity='full') or none")


@pytest.mark.parametrize("recomputed", ["moe", "mlp"])
def test_a_module_recomputed_alone_is_refused_by_name(megatron_cpu, moe_router_on_cpu, recomputed):
    batch = constant_padding(((30, (5, 3)),), (), padding=0)
    model = _model(**STATISTICS["z-loss"])
    if recomputed == "moe":
        model.decoder.layers[0].mlp.moe_layer_recompute = True
    else:  # the transformer layer's own flag (recompute_modules 'mlp')
        model.decoder.layers[0].recompute_mlp = True
    with pytest.raises(ValueError) as refused:
        planned(model, batch)
    assert str(refused.value) == RECOMPUTED_ALONE


def test_a_router_counts_statistics_only_where_one_is_on(megatron_cpu, moe_router_on_cpu):
    """megatron-core's own top-k router: no statistic where the balancing type's coefficient is 0
    (megatron-core 0.13 has no `is_aux_loss_enabled`: the type and the coefficient read there), each
    statistic of STATISTICS on its own counted."""
    from megatron_rl_patches.shared_prefix.moe_statistics import counts_statistics, is_router

    off = {"none": {}, "aux-loss at 0": dict(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.0),
           "seq-aux-loss at 0": dict(moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=0.0)}
    for name, overrides in {**off, **STATISTICS}.items():
        router = _model(**overrides).decoder.layers[0].mlp.router  # as megatron-core's MoE layer builds it
        if name == "global-aux-loss" and not hasattr(router, "reset_global_aux_loss_tracker"):
            continue  # megatron-core 0.13 has no global_aux_loss
        assert is_router(router) and counts_statistics(router) is (name not in off), name


def test_a_router_seeing_other_rows_than_the_plans_stream_is_refused_whole(megatron_cpu, moe_router_on_cpu):
    """A planned router in training handed fewer rows than the plan's stream at one tensor-parallel
    rank (neither the whole stream nor a sequence-parallel share of it): refused, its words whole."""
    from megatron_rl_patches.shared_prefix import moe_statistics, prepare_shared_prefix, shared_prefix_params

    batch = constant_padding(((30, (5, 3)),), (), padding=0)
    model = prepare_shared_prefix(_model(**STATISTICS["z-loss"]))
    params = shared_prefix_params(batch.plan())
    stream = moe_statistics.shared_prefix_plan_of(params).physical_length
    router = model.decoder.layers[0].mlp.router
    setattr(router, moe_statistics.LAYER_PARAMS, params)  # as the layer's call hands it
    with pytest.raises(ValueError) as refused:
        router.routing(torch.zeros(stream - 1, 1, router.config.num_moe_experts))
    assert str(refused.value) == (f"shared prefix: the router sees {stream - 1} rows, the plan's stream {stream}: a "
                                  "router's statistics are counted on the whole stream or on its sequence-parallel "
                                  "share")
