"""MTP under a sharing plan at the edge of the stream: a micro-batch with no padding whose last
sample, another's prefix, ends at the stream's last row, so a depth's last rows read the tokens
ahead up to that very row (a row off there reads another token and shares less than it should);
the main loss, each depth's MTP loss and every gradient equal the samples packed whole, each
depth's layer computing exactly the rows its samples share."""
from __future__ import annotations

import pytest
from kit.mtp_gpt import build_mtp_gpt, distinct_mtp_rows, layer_rows, mtp_pass, mtp_takes_packed_input
from kit.shared_prefix import grpo_batch, ordinary, packed_batch, planned

from megatron_rl_patches.testing.compare import grad_error, relative_error

pytestmark = pytest.mark.megatron


@pytest.mark.parametrize("positions", ["rope", "learned_absolute"])
def test_without_padding_each_depths_last_rows_read_the_streams_last_tokens(megatron_cpu, positions):
    """With learned absolute positions the MTP block embeds each row's own position in its sample
    (the block's inputs as the micro-batch packed them), as the main embedding does."""
    if not mtp_takes_packed_input():
        pytest.skip("this megatron-core's MTP refuses packed sequences (its own assertion; 0.13)")
    from megatron_rl_patches.testing.megatron_cpu import tiny_gpt_config

    first, second = grpo_batch(((20, (5, 6)),), (), padding=0).sequences
    batch = packed_batch([first, second, first[:-2]])  # the last sample: the first's prefix, ending the stream
    assert int(batch.cu_seqlens[-1]) == batch.tokens.size(1)
    model = build_mtp_gpt(tiny_gpt_config(mtp_num_layers=2, num_query_groups=2), position_embedding_type=positions)
    want = mtp_pass(model, batch, ordinary)
    seen, hooks = layer_rows(model)
    got = mtp_pass(model, batch, planned)
    for hook in hooks:
        hook.remove()
    assert relative_error(got["loss"], want["loss"]) < 1e-6
    assert want["mtp"].abs().min() > 0 and relative_error(got["mtp"], want["mtp"]) < 1e-6
    assert grad_error(got["grads"], want["grads"]) < 2e-6
    assert seen == [distinct_mtp_rows(batch, depth) for depth in (1, 2)]


def test_megatron_cores_rolls_are_wrapped_once_however_many_models_are_prepared(megatron_cpu):
    """The label and depth rolls are patched once a process: a second model prepared adds no second
    wrapper around the first (each call would go through both)."""
    if not mtp_takes_packed_input():
        pytest.skip("this megatron-core's MTP refuses packed sequences (its own assertion; 0.13)")
    from megatron.core.models.gpt import gpt_model
    from megatron.core.transformer import multi_token_prediction

    from megatron_rl_patches.shared_prefix import prepare_shared_prefix
    from megatron_rl_patches.testing.megatron_cpu import tiny_gpt_config

    for _ in range(2):
        prepare_shared_prefix(build_mtp_gpt(tiny_gpt_config(mtp_num_layers=1)))
    label = "process_mtp_loss" if hasattr(gpt_model, "process_mtp_loss") else "roll_tensor"
    for module, name in ((gpt_model, label), (multi_token_prediction, "roll_tensor")):
        inner = getattr(module, name).__wrapped__  # megatron-core's own function, under one wrapper
        assert not [key for key in vars(inner) if key.startswith("_megatron_rl_patches")], (module.__name__, name)
