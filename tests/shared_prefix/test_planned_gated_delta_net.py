"""megatron-core's own GatedDeltaNet under a shared-prefix plan, in training, against the truth:
each sample run on its own, unpacked (megatron-core's GatedDeltaNet refuses packed input, so the
samples packed whole cannot be the reference here). A tiny real GPTModel of 3 gated delta nets and
1 self-attention layer (Qwen3.5's mix): log-probs, entropy and every parameter's gradient equal
within float32's noise (2e-6); in float64 (the recurrence token by token in float64,
`sequential_gated_delta_rule`, on both sides) log-probs within 1e-10 and gradients within 1e-12 above
the last gated delta net, 1e-7 below it: megatron-core's own forward rounds alpha and the output gate
to float32 (`alpha.float()`, `gate.float()`), so a gradient through them keeps float32's last bit
(measured 4e-8 on in_proj, 2e-15 above). Prompts across a 64-row chunk and shorter than the
convolution's window. One layer alone over a tree of segments (a grandchild, a parent shorter than
the window) against the whole lines it stands for. An ordinary call of a prepared model is
unchanged bit for bit."""
from __future__ import annotations

import pytest
import torch
from kit.shared_prefix import grpo_batch, objective, planned, scores

from megatron_rl_patches.testing.compare import collect_grads, grad_error, relative_error

pytestmark = pytest.mark.megatron


@pytest.fixture(autouse=True)
def served():
    pytest.importorskip("megatron.core")
    from megatron_rl_patches.testing.gdn_gpt import megatron_gated_delta_net_served

    if not megatron_gated_delta_net_served():
        pytest.skip("megatron-core's GatedDeltaNet is not 0.16's megatron.core.ssm.gated_delta_net")
TOL = {torch.float32: 2e-6, torch.float64: 1e-10}
BELOW_FLOAT32_CASTS = 1e-7  # float64: a gradient through megatron-core's float32 alpha and gate

# prompts of 70 (across megatron-core's 64-row chunk) or 20 (float64: token by token, no chunks) and
# 2 (shorter than the 3 rows the convolution looks back), responses of 1 to 6 rows, a sample alone
# and padding
BATCHES = {torch.float32: dict(groups=((70, (5, 1)), (2, (6, 4))), alone=(12,), padding=4),
           torch.float64: dict(groups=((20, (5, 3, 1)), (2, (6, 4))), alone=(7,), padding=4)}


def _model(dtype):
    from megatron_rl_patches.testing.gdn_gpt import build_gated_delta_net_gpt, tiny_gated_delta_net_config

    config = tiny_gated_delta_net_config(params_dtype=dtype, pipeline_dtype=dtype)
    return build_gated_delta_net_gpt(config, seed=4).to(dtype)


def _each_alone(model, batch):
    """Logits [1, rows, V] of the sample rows, each sample run on its own (no packing)."""
    logits = []
    for start, end in zip(batch.cu_seqlens[:batch.samples].tolist(), batch.cu_seqlens[1:batch.samples + 1].tolist()):
        ids = batch.tokens[:, start:end]
        logits.append(model(ids, torch.arange(end - start)[None], None))
    return torch.cat(logits, dim=1)


def _run(model, batch, route):
    log_probs, entropy = scores(route(model, batch), batch)
    objective(log_probs, entropy).backward()
    return log_probs.detach(), entropy.detach(), collect_grads(model)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_a_planned_gated_delta_net_equals_each_sample_run_alone(megatron_cpu, dtype):
    from megatron_rl_patches.testing.gdn_gpt import gated_delta_net_on_cpu, sequential_gated_delta_rule

    with gated_delta_net_on_cpu(sequential_gated_delta_rule if dtype == torch.float64 else None):
        model = _model(dtype)
        batch = grpo_batch(**BATCHES[dtype])
        want = _run(model, batch, _each_alone)
        got = _run(model, batch, planned)
    from megatron_rl_patches.shared_prefix import shared_prefix_reason

    assert shared_prefix_reason(model, training=True) is None  # prepared by `planned`: the doors accept it
    prompt = BATCHES[dtype]["groups"][0][0]
    assert batch.plan().stats.saved_tokens == (len(BATCHES[dtype]["groups"][0][1]) - 1) * prompt + 2
    assert relative_error(got[0], want[0]) <= TOL[dtype]
    assert relative_error(got[1], want[1]) <= TOL[dtype]
    linear = [name for name in want[2] if ".self_attention.A_log" in name]
    assert len(linear) == 3  # every gated delta net's parameters took part
    if dtype == torch.float32:
        assert grad_error(got[2], want[2]) <= TOL[dtype]
    else:
        above = {name for name in want[2] if name.startswith(("decoder.layers.3.", "decoder.final", "output"))}
        assert len(above) > 5
        assert grad_error({n: got[2][n] for n in above}, {n: want[2][n] for n in above}) <= 1e-12
        assert grad_error(got[2], want[2]) <= BELOW_FLOAT32_CASTS


def test_an_ordinary_call_of_a_prepared_gated_delta_net_is_unchanged(megatron_cpu):
    from megatron_rl_patches.shared_prefix import prepare_shared_prefix
    from megatron_rl_patches.shared_prefix.gated_delta_net import PlannedGatedDeltaNet
    from megatron_rl_patches.testing.gdn_gpt import gated_delta_net_on_cpu

    with gated_delta_net_on_cpu():
        model = _model(torch.float32)
        ids = torch.randint(0, 64, (1, 21), generator=torch.Generator().manual_seed(1))
        before = model(ids, torch.arange(21)[None], None)
        prepare_shared_prefix(model)
        after = model(ids, torch.arange(21)[None], None)
    assert sum(isinstance(m, PlannedGatedDeltaNet) for m in model.modules()) == 3
    assert torch.equal(before, after)


def test_a_tree_of_segments_continues_each_parent(megatron_cpu):
    """Segments at depth 4, parents of 2 rows and of 1 (the window is 3), siblings, an empty one:
    each equals its whole line (root, ancestors, itself) run by megatron-core's own forward, outputs
    and input gradients."""
    from megatron_rl_patches.shared_prefix.gated_delta_net import Segment, planned_forward, prepare_gated_delta_net
    from megatron_rl_patches.testing.gdn_gpt import gated_delta_net_on_cpu

    segments = (Segment(0, 2), Segment(2, 70, 0), Segment(70, 75, 1), Segment(75, 79, 0), Segment(79, 80),
                Segment(80, 80, 0), Segment(80, 81, 1), Segment(81, 85, 6))
    # the segments of each leaf's line, root first (the last: a window through a parent of one row)
    lines = ([0, 1, 2], [0, 3], [4], [0, 1, 6, 7])
    with gated_delta_net_on_cpu():
        layer = _model(torch.float64).decoder.layers[0].self_attention
        hidden = torch.randn(85, 1, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
        hidden.requires_grad_(True)
        weights = torch.randn(85, 1, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
        prepare_gated_delta_net(layer)
        got, _ = planned_forward(layer, hidden, segments)
        (got * weights).sum().backward()
        got_grad, hidden.grad = hidden.grad, None
        want_grad, counted = torch.zeros_like(hidden), torch.empty(0, dtype=torch.int64)
        for line in lines:
            rows = torch.cat([torch.arange(segments[i].start, segments[i].end) for i in line])
            alone = hidden.detach()[rows].requires_grad_(True)
            out, _ = layer(alone, None)
            own = ~torch.isin(rows, counted)  # each row's output counted once, on the first line through it
            counted = torch.cat([counted, rows])
            assert (out[own] - got[rows[own]]).abs().max() <= 1e-6  # megatron-core's chunked rule: float32 inside
            (out[own] * weights[rows[own]]).sum().backward()
            want_grad[rows] += alone.grad
    assert counted.unique().numel() == 85
    # the rows of an inner segment are computed once: their gradient is the sum over every line through them
    assert (got_grad - want_grad).abs().max() <= 1e-6 * want_grad.abs().max()


def test_outside_deterministic_mode_without_fla_a_plan_is_refused_by_name(megatron_cpu):
    from megatron_rl_patches.shared_prefix.gated_delta_net import Segment, planned_forward
    from megatron_rl_patches.testing.gdn_gpt import gated_delta_net_on_cpu

    with gated_delta_net_on_cpu():
        layer = _model(torch.float32).decoder.layers[0].self_attention
        layer.config.deterministic_mode = False
        with pytest.raises(ValueError, match="deterministic_mode"):
            planned_forward(layer, torch.zeros(4, 1, 32), (Segment(0, 4),))
        with pytest.raises(ValueError, match="segments cover 3 rows"):
            planned_forward(layer, torch.zeros(4, 1, 32), (Segment(0, 3),))
