"""Issue 19, defect 4: a state-dict file holding a sparse (or other non-strided) tensor is refused
in the up-front check, naming the entry and its layout, before any weight is copied. Before the
fix the earlier entries were already copied when copy_ failed ("weights are now UNDEFINED")."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.megatron

LAYOUTS = {
    "sparse_coo": lambda t: t.to_sparse(),
    "sparse_csr": lambda t: t.to_sparse_csr(),
    "sparse_csc": lambda t: t.to_sparse_csc(),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_non_strided_tensors_are_refused_before_anything_is_copied(megatron_cpu, tmp_path, weights_kit, layout):
    from megatron_rl_patches import load_inference_weights
    from megatron_rl_patches.inference import CheckpointReadError

    state = megatron_cpu.gpt(seed=80).state_dict()
    name = "output_layer.weight"  # the last entry: every other weight would be copied before it
    assert list(state)[-1] == name or name in state
    state[name] = LAYOUTS[layout](state[name])
    torch.save(state, tmp_path / "sparse.pt")
    model = megatron_cpu.gpt(seed=81)
    before = weights_kit.state(model)
    with pytest.raises(CheckpointReadError, match=rf"{name} \(a torch\.{layout} tensor: save dense weights") as err:
        load_inference_weights(model, tmp_path / "sparse.pt")
    assert "UNDEFINED" not in str(err.value).upper()
    weights_kit.assert_same(weights_kit.state(model), before)
