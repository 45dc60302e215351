"""slime's own gated-delta-net layers (Qwen3.5's and Qwen3-Next's `Attention(HuggingfaceAttention)`,
slime_plugins/models/qwen3_5.py and qwen3_next.py, 624b824a) under a shared-prefix plan: a tiny hybrid
built from slime's spec (3 gated delta nets, 1 full attention; slime_gdn_ranks.py) against the same
GRPO groups packed whole as slime packs them (thd, cu_seqlens: slime's layer runs each sequence
alone): the sample rows' log-probs and entropy within 2e-6 and every parameter's gradient within
5e-5 of its scale (float32: measured 1.4e-6 and 2.4e-5; the recurrence's backward sums the remainders'
gradients into the prefix's state in another order, and a token-by-token rule in place of the chunked
one measures the same 2.4e-5), at one rank and at TP = 2 with sequence parallelism (slime's
layer is duplicated over the tensor-parallel ranks, the stream gathered around it); fewer tokens
embedded; at context parallelism refused by name. And slime's real `train_actor` on that hybrid
with MEGATRON_RL_PATCHES_SHARED_PREFIX=1 against 0: every number of the step equal within 1e-6."""
from __future__ import annotations

import sys

import pytest
import torch

pytestmark = pytest.mark.slime
TOL, GRAD_TOL = 2e-6, 5e-5


def _slime_plugins() -> None:
    if "slime_standins" not in sys.modules:  # the lane's conftest installs them where slime's source is found
        pytest.skip("slime is not importable; run `make test-slime SLIME=... MEGATRON_LM=...`")
    pytest.importorskip("slime_plugins.models.hf_attention", reason="slime_plugins is not exported in this lane")


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max()) / max(1.0, float(want.abs().max()))


@pytest.fixture(scope="module", params=[1, 2], ids=["1rank", "tp2sp"])
def layer_runs(request, tmp_path_factory):
    _slime_plugins()
    import slime_gdn_ranks

    from megatron_rl_patches.testing.multirank import run_multirank

    root = str(tmp_path_factory.mktemp("hf"))
    return run_multirank(slime_gdn_ranks.planned_and_packed, request.param, root, request.param > 1, timeout=400)


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next"])
def test_slimes_gated_delta_net_planned_equals_packed_whole(slime_cpu, layer_runs, kind):
    for rank in layer_runs:
        packed, planned = rank[kind]["packed"], rank[kind]["planned"]
        for field in ("log_probs", "entropy"):
            assert _relative(planned[field], packed[field]) <= TOL, field
        assert packed["grads"].keys() == planned["grads"].keys()
        assert any("linear_attn.conv1d" in name for name in packed["grads"])
        for name, want in packed["grads"].items():
            assert _relative(planned["grads"][name], want) <= GRAD_TOL, name
            assert float(want.abs().max()) > 0, name  # every parameter reached
        assert sum(planned["embedded"]) < sum(packed["embedded"])


def test_slimes_gated_delta_net_at_context_parallelism_is_refused_by_name(slime_cpu, layer_runs):
    for rank in layer_runs:
        for kind in ("qwen3_5", "qwen3_next"):
            reason = rank[kind]["cp2"]
            assert reason is not None and "slime's gated delta net layer" in reason
            assert "context_parallel_size=2" in reason
