"""DeepSeek sparse attention (megatron-core 0.19's DSA: GLM-5's and DeepSeek-V3.2's indexer, top-k
and sparse attention inside its absorbed MLA) under a shared-prefix plan against the same samples
packed whole (`thd`): each query's top 4 keys among those it may see, its indexer's rotary part at
each token's own position, its scoring plain and with ReLU (GLM-5's); log-probs and entropy within
1e-6 and every gradient within 2e-6 (float32).
What the plan cannot run of DSA is refused by name; on megatron-core before 0.19 DSA is refused whole
(its DSAttention refuses packed input)."""
from __future__ import annotations

import pytest
import torch
from kit.shared_prefix import grpo_batch, objective, ordinary, planned, scores
from kit.sparse_gpt import build_dsa_gpt, dsa_runs_on_cpu, tiny_dsa_config

from megatron_rl_patches.testing.compare import collect_grads, grad_error, relative_error

pytestmark = pytest.mark.megatron
TOL, GRAD_TOL = 1e-6, 2e-6
BATCH = dict(groups=((40, (5, 9, 2, 7)), (12, (4, 4))), alone=(6,), padding=3, seed=1)


@pytest.fixture
def dsa(megatron_cpu):
    if not dsa_runs_on_cpu():
        pytest.skip("this megatron-core's DSA does not run packed input on CPU (0.16's refuses it)")


def _run(model, batch, route):
    model.zero_grad(set_to_none=True)
    log_probs, entropy = scores(route(model, batch), batch)
    objective(log_probs, entropy).backward()
    return log_probs.detach(), entropy.detach(), collect_grads(model)


def test_sparse_attention_equals_the_packed_path(dsa):
    from megatron_rl_patches.shared_prefix import check_shared_prefix
    from megatron_rl_patches.shared_prefix.sparse_attention import PlannedSparseAttention

    batch = grpo_batch(**BATCH)
    model = build_dsa_gpt(tiny_dsa_config())
    check_shared_prefix(model, training=True)  # each door's check: the DSA layer's classes are known
    want, got = _run(model, batch, ordinary), _run(model, batch, planned)
    assert relative_error(got[0], want[0]) < TOL and relative_error(got[1], want[1]) < TOL
    assert grad_error(got[2], want[2]) < GRAD_TOL
    assert all(isinstance(layer.self_attention.core_attention, PlannedSparseAttention)
               for layer in model.decoder.layers)

    # GLM-5's scoring (ReLU on each head's score): 8 indexer heads, so no two keys tie at a query's k-th score
    relu = build_dsa_gpt(tiny_dsa_config(relu=True, dsa_indexer_n_heads=8))
    want_relu, got_relu = _run(relu, batch, ordinary), _run(relu, batch, planned)
    assert relative_error(got_relu[0], want_relu[0]) < TOL and grad_error(got_relu[2], want_relu[2]) < GRAD_TOL

    # negative control: the core run on the stream's own causal rule (not the plan's) misses
    core = model.decoder.layers[0].self_attention.core_attention
    planned_class, core.__class__ = core.__class__, core.__class__.__mro__[1]
    try:
        with torch.no_grad():
            stray = scores(planned(model, batch), batch)[0]
    finally:
        core.__class__ = planned_class
    assert relative_error(stray, want[0]) > 1e-3


@pytest.mark.parametrize(("field", "value", "words"), [
    ("dsa_indexer_loss_coeff", 0.1, "DSA's indexer loss in training"),
    ("params_dtype", torch.float64, "DSA sparse attention in float64"),
    ("dsa_kernel_backend", "tilelang", "DSA's fused kernels"),
])
def test_what_the_plan_cannot_run_of_dsa_is_refused_by_name(dsa, field, value, words):
    batch = grpo_batch(groups=((30, (5, 7)),), alone=(), padding=0)
    model = build_dsa_gpt(tiny_dsa_config())
    setattr(model.config, field, value)  # one config object: every layer reads it at forward
    with pytest.raises(ValueError, match=f"shared prefix: {words}"):
        planned(model, batch)


def test_dsa_on_a_megatron_core_before_0_19_is_refused_by_name(megatron_cpu):
    """0.16's DSAttention refuses packed input: the plan refuses DSA there, naming the version."""
    if dsa_runs_on_cpu():
        pytest.skip("this megatron-core's DSA runs under a plan (test_sparse_attention_equals_the_packed_path)")
    from kit.latent_gpt import build_mla_gpt, tiny_mla_config

    batch = grpo_batch(groups=((30, (5, 7)),), alone=(), padding=0)
    model = build_mla_gpt(tiny_mla_config())
    model.config.experimental_attention_variant = "dsa"
    with pytest.raises(ValueError, match="shared prefix: DSA sparse attention on megatron-core 0.1[0-8]"):
        planned(model, batch)
