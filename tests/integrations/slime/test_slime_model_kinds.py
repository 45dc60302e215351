"""slime's own layers as shared-prefix model kinds (`integrations/slime/model_kinds.py`): registered at
slime's shared-prefix door (`slime_prefix_pass`), never named by the core. slime's GLM-5 DSA layer is
refused with its own reason once slime's kinds are registered, and as a module the plan does not know
without them (a hand-written loop over slime's model never runs it). slime's gated delta net layers
run planned in the slime lane (lane/test_slime_shared_prefix_gdn_lane.py)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatron_rl_patches.shared_prefix import kinds

pytestmark = pytest.mark.megatron


@pytest.fixture
def no_framework_kinds(monkeypatch):
    """The kinds registry as a process without slime's door has it (restored after the test)."""
    monkeypatch.setattr(kinds, "_REGISTERED", [])
    monkeypatch.delenv("MEGATRON_RL_PATCHES_SHARED_PREFIX", raising=False)


def _refusal(model) -> str:
    from megatron_rl_patches.shared_prefix import check_shared_prefix

    with pytest.raises(ValueError) as caught:
        check_shared_prefix(model, training=False)
    return str(caught.value)


def test_slimes_glm5_sparse_attention_layer_is_refused_by_name(megatron_cpu, no_framework_kinds):
    """slime's GLM-5 layer (slime_plugins/models/glm5: its tilelang kernels import CUDA-only code, so it
    cannot be built here; a class of its name stands in) is refused with its reason, not the generic one,
    once slime's door registered slime's kinds; before, as a module the plan does not know."""
    from megatron.core.transformer.attention import SelfAttention

    from megatron_rl_patches.integrations.slime.fused_step import slime_prefix_pass
    from megatron_rl_patches.testing.packed_gpt import build_packed_gpt

    class DSAMultiLatentAttention(SelfAttention):
        def forward(self, hidden_states, attention_mask, packed_seq_params=None, **kwargs):
            raise AssertionError("a refused model never runs")

    class DSAMLASelfAttention(DSAMultiLatentAttention):  # slime's GLM-5 spec builds this subclass
        pass

    model = build_packed_gpt(seq_length=256)
    model.decoder.layers[0].self_attention.__class__ = DSAMLASelfAttention
    assert "a module the plan does not know (" in _refusal(model)  # the core alone: refused all the same
    assert slime_prefix_pass(SimpleNamespace(), [model], "slime's log-prob pass", training=False) is None  # off
    message = _refusal(model)
    assert "slime's GLM-5 DSA layer (its indexer and sparse MLA are tilelang CUDA kernels taking one contiguous" in (
        message)
    assert "DSAMLASelfAttention at decoder.layers.0.self_attention" in message and "does not know" not in message
