"""Multi-latent attention (megatron-core's MLASelfAttention, as DeepSeek-V3, Kimi-K2 and
GLM-4.7-Flash build it) under a shared-prefix plan against the same samples packed whole (`thd`):
its own rotary part (YaRN with DeepSeek's mscale, and plain RoPE) at each token's own position,
queries and keys of width 8 + 4 against values of width 6 in the package's attention, MLA's own
softmax scale; log-probs and entropy within 1e-6 and every gradient within 2e-6 (float32) / 1e-12
(float64). What the plan cannot run in MLA is refused by name."""
from __future__ import annotations

import pytest
import torch
from kit.latent_gpt import build_mla_gpt, mla_takes_packed_input, tiny_mla_config
from kit.shared_prefix import grpo_batch, objective, ordinary, planned, scores

from megatron_rl_patches.testing import layouts
from megatron_rl_patches.testing.compare import collect_grads, grad_error, relative_error

pytestmark = pytest.mark.megatron


@pytest.fixture(autouse=True)
def _mla_with_packing(megatron_cpu):
    if not mla_takes_packed_input():
        pytest.skip("this megatron-core's MLA does not run packed input on CPU (0.13)")
TOL = 1e-6
GRAD_TOL = {torch.float32: 2e-6, torch.float64: 1e-12}


def _run(model, batch, route):
    log_probs, entropy = scores(route(model, batch), batch)
    objective(log_probs, entropy).backward()
    return log_probs.detach(), entropy.detach(), collect_grads(model)


CASES = [("yarn", torch.float32), ("rope", torch.float32), ("yarn", torch.float64)]


@layouts.mark("thd")
@pytest.mark.parametrize(("rope_type", "dtype"), CASES, ids=[f"{r}-{str(d)[6:]}" for r, d in CASES])
def test_multi_latent_attention_equals_the_packed_path(megatron_cpu, rope_type, dtype):
    batch = grpo_batch(((40, (5, 9, 2, 7)), (12, (4, 4))), (6,), padding=3, seed=1)
    model = build_mla_gpt(tiny_mla_config(rope_type, dtype))
    want, got = _run(model, batch, ordinary), _run(model, batch, planned)
    assert relative_error(got[0], want[0]) < TOL and relative_error(got[1], want[1]) < TOL
    assert grad_error(got[2], want[2]) < GRAD_TOL[dtype]
    assert any("linear_kv_down_proj" in name for name in got[2])  # the latent projections got gradients


def test_the_negative_control_positions_counted_along_the_stream_differ(megatron_cpu):
    """MLA's table read at each physical row (its stream index, not its position) misses."""
    from megatron_rl_patches.shared_prefix import mla, prepare_shared_prefix, shared_prefix_params

    batch = grpo_batch(((40, (6, 8)),), (), padding=0)
    model = prepare_shared_prefix(build_mla_gpt(tiny_mla_config()))
    want = scores(ordinary(model, batch), batch)[0]
    plan = batch.plan()
    plan.positions = torch.arange(plan.physical_length)
    got = scores(model(batch.tokens, None, None, packed_seq_params=shared_prefix_params(plan)), batch)[0]
    assert isinstance(model.decoder.layers[0].self_attention.rotary_pos_emb, mla.PlannedRotary)
    prefix_and_first = 46
    assert relative_error(got[:prefix_and_first], want[:prefix_and_first]) < TOL
    assert relative_error(got, want) > 1e-4


def test_an_ordinary_call_after_prepare_is_unchanged_bit_for_bit(megatron_cpu):
    batch = grpo_batch(((30, (5, 7)),), (6,), padding=3)
    model = build_mla_gpt(tiny_mla_config())
    before = ordinary(model, batch).detach()
    planned(model, batch)
    assert torch.equal(ordinary(model, batch).detach(), before)


@pytest.mark.parametrize(("field", "value", "words"), [
    ("apply_rope_fusion", True, "apply_rope_fusion"),
    ("rotary_interleaved", True, "rotary_interleaved"),
])
def test_what_mla_cannot_run_under_a_plan_is_refused_by_name(megatron_cpu, field, value, words):
    batch = grpo_batch(((30, (5, 7)),), (), padding=0)
    model = build_mla_gpt(tiny_mla_config())
    setattr(model.config, field, value)  # one config object: every layer reads it at forward
    with pytest.raises(ValueError, match=f"shared prefix: .*{words}"):
        planned(model, batch)
