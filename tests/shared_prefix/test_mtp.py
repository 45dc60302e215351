"""Multi-token prediction (megatron-core's MTP block, as MiMo and GLM-4.7-Flash train it) under a
shared-prefix plan against the same samples packed whole: at each depth the block sees each
sample's own next tokens (a prefix's last row has G of them), so each depth runs a stream of its
own, the prefix shared one row less per depth (its layer computes exactly the rows whose samples
agree up to d tokens ahead, counted here independently of the plan, fewer than the packed rows);
the main loss, the MTP loss megatron-core logs per depth and every gradient (the MTP loss's own
included) within 1e-6 / 2e-6 (float32) and 1e-12 (float64), at depths 1 and 2, with a loss mask
over random padding; and a DeepSeek-shaped model (multi-latent attention, MoE with expert-bias
updates and an aux loss, MTP) with its counts and updated bias."""
from __future__ import annotations

import pytest
import torch
from kit.moe_statistics import STATISTICS, constant_padding, read_statistics, reset_statistics, varying_padding
from kit.mtp_gpt import build_mtp_gpt, distinct_mtp_rows, layer_rows, mtp_pass, mtp_takes_packed_input
from kit.shared_prefix import grpo_batch, ordinary, planned

from megatron_rl_patches.testing import layouts
from megatron_rl_patches.testing.compare import grad_error, relative_error

pytestmark = pytest.mark.megatron


@pytest.fixture(autouse=True)
def _mtp_with_packing(megatron_cpu):
    if not mtp_takes_packed_input():
        pytest.skip("this megatron-core's MTP refuses packed sequences (its own assertion; 0.13)")
TOL = 1e-6
GRAD_TOL = {torch.float32: 2e-6, torch.float64: 1e-12}
CASES = [(1, torch.float32), (2, torch.float32), (1, torch.float64)]


def _agree(got: dict, want: dict, dtype=torch.float32) -> None:
    assert relative_error(got["loss"], want["loss"]) < TOL
    assert want["mtp"].abs().min() > 0 and relative_error(got["mtp"], want["mtp"]) < TOL
    assert grad_error(got["grads"], want["grads"]) < GRAD_TOL[dtype]
    assert any(".mtp." in f".{name}" for name in want["grads"])


def _equals_the_packed_path(batch, depth: int, dtype, **config) -> None:
    """A model of MTP depth `depth` trained on `batch` planned against packed (a padding sequence of
    one repeated id on one row, as the doors plan it for this model): losses, gradients, and each
    depth's layer computing the rows its samples share once, fewer than packed."""
    from megatron_rl_patches.shared_prefix import repeated_padding_alike
    from megatron_rl_patches.testing.megatron_cpu import tiny_gpt_config

    model = build_mtp_gpt(tiny_gpt_config(mtp_num_layers=depth, params_dtype=dtype, pipeline_dtype=dtype, **config))
    once = repeated_padding_alike(model)
    assert once
    want = mtp_pass(model, batch, ordinary)
    seen, hooks = layer_rows(model)
    got = mtp_pass(model, batch, lambda m, b, **kw: planned(m, b, pad_to=4, repeated_padding_once=once, **kw))
    for hook in hooks:
        hook.remove()
    _agree(got, want, dtype)
    expected = [distinct_mtp_rows(batch, d) for d in range(1, depth + 1)]
    assert seen == expected and all(rows < batch.tokens.size(1) for rows in expected), (seen, expected)


@layouts.mark("thd")
@layouts.mark("mtp")
@pytest.mark.parametrize(("depth", "dtype"), CASES, ids=[f"mtp{d}-{str(t)[6:]}" for d, t in CASES])
def test_mtp_equals_the_packed_path(megatron_cpu, depth, dtype):
    batch = constant_padding(((30, (5, 9, 3)), (8, (4, 6))), (7,), padding=4)
    _equals_the_packed_path(batch, depth, dtype, num_query_groups=2)


PADDING_CASES = [(1, torch.float32), (1, torch.float64)]


@layouts.mark("thd")
@layouts.mark("mtp")
@pytest.mark.parametrize(("depth", "dtype"), PADDING_CASES, ids=[f"mtp{d}-{str(t)[6:]}" for d, t in PADDING_CASES])
def test_each_padding_row_counts_by_its_own_id(megatron_cpu, depth, dtype):
    """Two padding sequences of varying ids and no loss mask: megatron-core's packed path computes
    each padding row by its own id and rolls each padding sequence on its own, its MTP loss counting
    every row; the plan's main stream and each depth's compute them alike."""
    _equals_the_packed_path(varying_padding(((30, (5, 9, 3)),), (6,), paddings=(5, 4)), depth, dtype)


def test_a_loss_mask_over_padding_of_any_ids(megatron_cpu):
    """Padding of random ids under a loss mask that leaves the padding out, as a framework's mask
    does (and without one: `test_each_padding_row_counts_by_its_own_id`)."""
    from megatron_rl_patches.testing.megatron_cpu import tiny_gpt_config

    batch = grpo_batch(((30, (5, 9)),), (6,), padding=5, seed=2)
    mask = torch.zeros_like(batch.labels, dtype=torch.float32)
    mask[0, batch.rows] = 1.0
    model = build_mtp_gpt(tiny_gpt_config(mtp_num_layers=1))
    want = mtp_pass(model, batch, ordinary, loss_mask=mask)
    _agree(mtp_pass(model, batch, planned, loss_mask=mask), want)


def test_the_negative_control_the_logical_states_in_a_depth_stream_fail_loudly(megatron_cpu, monkeypatch):
    """Without the MTP layer's hook the layer meets its depth's physical ids against the logical
    states: refused by megatron-core's own shapes, never a silent loss."""
    from megatron_rl_patches.shared_prefix import mtp
    from megatron_rl_patches.testing.megatron_cpu import tiny_gpt_config

    monkeypatch.setattr(mtp, "physical_layer_inputs", lambda *args, **kwargs: None)
    batch = constant_padding(((30, (5, 9)),), (), padding=0)
    model = build_mtp_gpt(tiny_gpt_config(mtp_num_layers=1))
    with pytest.raises((RuntimeError, ValueError, AssertionError, IndexError)):
        mtp_pass(model, batch, planned)


def test_the_plan_reads_as_its_logical_sequences(megatron_cpu):
    from megatron_rl_patches.shared_prefix import mtp

    for batch in (constant_padding(((6, (2, 3)),), (2,), padding=3), varying_padding(((6, (2, 3)),), (2,))):
        for once in (False, True):  # each padding sequence as packed, a run of one id on one row or not
            plan = batch.plan(repeated_padding_once=once)
            assert mtp.logical_params(plan).cu_seqlens_q.tolist() == batch.cu_seqlens.tolist()
            assert torch.equal(mtp.logical_positions(plan)[None], batch.positions)


@layouts.mark("moe")
def test_a_deepseek_shaped_model_mla_moe_expert_bias_mtp(megatron_cpu, moe_router_on_cpu):
    from kit.latent_gpt import build_mla_gpt, tiny_mla_config

    statistics = {**STATISTICS["expert-bias"], **STATISTICS["aux-loss"]}
    config = tiny_mla_config(mtp_num_layers=1, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
                             moe_token_dispatcher_type="allgather", add_bias_linear=False, **statistics)
    model = build_mla_gpt(config)
    from megatron_rl_patches.shared_prefix import shared_prefix_reason

    assert shared_prefix_reason(model, training=True) is None  # what runs exact below is what the doors accept
    batch = varying_padding(((30, (5, 9, 3)),), (6,), paddings=(2, 1))  # the MTP layer's statistics count them too
    runs = []
    for route in (ordinary, lambda m, b, **kw: planned(m, b, pad_to=4, **kw)):
        bias_before = reset_statistics(model)
        seen, hooks = layer_rows(model)
        runs.append({**mtp_pass(model, batch, route), **read_statistics(model, bias_before), "rows": seen})
        for hook in hooks:
            hook.remove()
    want, got = runs
    _agree(got, want)
    assert want["rows"] == [batch.tokens.size(1)] and got["rows"] == [distinct_mtp_rows(batch, 1)] < want["rows"]
    assert len(want["counts"]) == 3  # two decoder layers and the MTP layer
    assert all(torch.equal(g, w) for g, w in zip(got["counts"], want["counts"]))
    assert all(torch.equal(g, w) for g, w in zip(got["bias"], want["bias"]))
    assert all(relative_error(got["losses"][name], values) < TOL for name, values in want["losses"].items())
