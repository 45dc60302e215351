"""Which models compute every row of a padding sequence of one repeated id alike
(`repeated_padding_alike`, what the doors ask before computing such a sequence on one row): a real
megatron-core GPTModel with rotary positions does; one with an attention sink, learned absolute
positions or a layer carrying a state along the rows (each kind the plan runs, known by its class)
does not. Exactness both ways: tests/shared_prefix/test_moe_statistics.py."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.megatron

# layers the kinds know carry a state along the rows, by their class names (the fallback kinds' way: a stand-in of
# that name is known so); slime's own layers by their code, through slime's registered kind (below)
RECURRENT = ["megatron.core.ssm.gated_delta_net.GatedDeltaNet",  # megatron-core 0.16's
             "megatron.core.ssm.gated_delta_net.gdn.GatedDeltaNet",  # and later ones'
             "slime_plugins.models.qwen3_next.Qwen3NextGatedDeltaNet",
             "megatron_rl_patches.inference.gated_delta_net.GatedDeltaNetLayer",
             "megatron.core.ssm.mamba_mixer.MambaMixer"]


def _model(**kwargs):
    from megatron_rl_patches.testing.packed_gpt import build_packed_gpt

    return build_packed_gpt(seq_length=64, seed=1, **kwargs)


def test_a_rotary_softmax_model_computes_a_run_of_one_id_alike(megatron_cpu):
    from megatron_rl_patches.shared_prefix import repeated_padding_alike

    assert repeated_padding_alike(_model()) and repeated_padding_alike([_model(position_embedding_type="none")])


def test_a_sink_or_learned_positions_make_the_rows_differ(megatron_cpu):
    from megatron_rl_patches.shared_prefix import repeated_padding_alike

    assert not repeated_padding_alike(_model(position_embedding_type="learned_absolute"))
    sink = _model()
    sink.config.softmax_type = "off-by-one"  # what the layers read: their config is the model's
    assert not repeated_padding_alike(sink)


@pytest.mark.parametrize("name", RECURRENT)
def test_a_layer_carrying_a_state_along_the_rows_makes_them_differ(megatron_cpu, name):
    from megatron_rl_patches.shared_prefix import repeated_padding_alike

    module, qualname = name.rsplit(".", 1)
    layer = type(qualname, (torch.nn.Module,), {"__module__": module, "__qualname__": qualname})
    model = _model()
    model.decoder.layers[0].add_module("mixer", layer())
    assert not repeated_padding_alike(model)


def test_a_registered_kind_carrying_a_state_makes_the_rows_differ(megatron_cpu, monkeypatch):
    """A framework's own recurrent layer (slime's gated delta net: its kind says its continuation is carried
    along the rows) is known through the kind its integration registers."""
    from megatron_rl_patches.integrations.slime.model_kinds import SLIME_GATED_DELTA_NET
    from megatron_rl_patches.shared_prefix import kinds, repeated_padding_alike
    from megatron_rl_patches.shared_prefix.kinds.kind import ByCode, Continuation, known_as

    assert SLIME_GATED_DELTA_NET.continuation.along_rows
    recurrent = ByCode("a framework's recurrent layer", continuation=Continuation(along_rows=True))

    @known_as(recurrent)
    class Layer(torch.nn.Module):
        def forward(self, hidden_states, packed_seq_params=None):
            return hidden_states

    monkeypatch.setattr(kinds, "_REGISTERED", [])
    model = _model()
    model.decoder.layers[0].add_module("mixer", Layer())
    assert repeated_padding_alike(model)  # not registered: its kind unknown here (the refusals name it)
    kinds.register(recurrent)
    assert not repeated_padding_alike(model)
