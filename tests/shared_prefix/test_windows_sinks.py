"""Sliding windows and attention sinks under a shared-prefix plan, on a real megatron-core GPTModel on
CPU: each sample run alone through megatron-core's own local attention (its window band over the
sample, its SoftmaxOne sink) against the plan's forward of the packed micro-batch (a multi-turn tree:
a remainder's window reaches back into its ancestors' rows, counted in the sample's own positions):
log-probs and entropy within 1e-6 (float32), every gradient within 2e-6, the learnable sink's too;
a window only some layers take (`window_attn_skip_freq`) read per layer."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from kit.shared_prefix import objective, planned, tree_batch

from megatron_rl_patches.testing.compare import collect_grads, grad_error, relative_error

pytestmark = pytest.mark.megatron


def _model(**overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_rl_patches.testing.megatron_cpu import tiny_gpt_config
    from megatron_rl_patches.testing.packed_gpt import build_packed_gpt

    missing = set(overrides) - {f.name for f in dataclasses.fields(TransformerConfig)}
    if missing:
        pytest.skip(f"this megatron-core has no {', '.join(sorted(missing))}")
    try:
        model = build_packed_gpt(seq_length=256, seed=5, config=tiny_gpt_config(num_query_groups=2, **overrides))
    except AssertionError as exc:  # megatron-core 0.13's local attention: windows on Transformer Engine only
        if "only supported by TEDotProductAttention" not in str(exc):
            raise
        pytest.skip("this megatron-core's local attention takes no sliding window (the reference)")
    with torch.no_grad():  # sinks large enough to matter (megatron-core initializes them near 0)
        for name, param in model.named_parameters():
            if name.endswith("softmax_offset"):
                param.copy_(torch.linspace(-1.0, 1.5, param.numel()))
    return model


def _alone(model, batch):
    """Each sample on its own (no packing: megatron-core's own window and sink), log-probs and entropy."""
    from megatron_rl_patches import log_probs_and_entropy

    results = []
    for i, sample in enumerate(batch.sequences):
        start = int(batch.cu_seqlens[i])
        ids = batch.tokens[:, start:start + len(sample)]
        logits = model(ids, torch.arange(len(sample))[None], None)
        results.append(log_probs_and_entropy(logits[0], batch.labels[0, start:start + len(sample)],
                                             with_entropy=True))
    return torch.cat([r[0] for r in results]), torch.cat([r[1] for r in results])


def _planned(model, batch):
    from megatron_rl_patches import log_probs_and_entropy

    logits = planned(model, batch)
    return log_probs_and_entropy(logits[0, batch.rows], batch.labels[0, batch.rows], with_entropy=True)


@pytest.mark.parametrize("overrides", [
    dict(window_size=(5, 0)),
    dict(window_size=(7, 0), window_attn_skip_freq=2),
    dict(softmax_type="learnable"),
    dict(softmax_type="off-by-one", window_size=(6, 0)),
], ids=["window", "window-every-other-layer", "learnable-sink", "off-by-one-window"])
def test_windows_and_sinks_equal_each_sample_run_alone(megatron_cpu, overrides):
    batch = tree_batch(system=12, turns=((3, 5, 2), (2, 4, 2)), per_turn=True, padding=3, seed=2)
    model = _model(**overrides)
    results = []
    for run in (_alone, _planned):
        log_probs, entropy = run(model, batch)
        objective(log_probs, entropy).backward()
        results.append((log_probs.detach(), entropy.detach(), collect_grads(model)))
    (want_lp, want_ent, want_grads), (lp, ent, grads) = results
    assert relative_error(lp, want_lp) < 1e-6 and relative_error(ent, want_ent) < 1e-6
    assert grad_error(grads, want_grads) < 2e-6
    sinks = [name for name in grads if name.endswith("softmax_offset")]
    assert (len(sinks) == 2) == (overrides.get("softmax_type") == "learnable")
    assert all(float(grads[name].abs().max()) > 0 for name in sinks)


def test_a_window_reaching_later_tokens_is_refused_by_name():
    from types import SimpleNamespace

    from megatron_rl_patches.shared_prefix.kinds.windows_sinks import layer_window

    assert layer_window(SimpleNamespace(window_size=(4, 0), window_attn_skip_freq=None), 1) == 4
    assert layer_window(SimpleNamespace(window_size=(4, 0), window_attn_skip_freq=[0, 1]), 1) is None
    assert layer_window(SimpleNamespace(window_size=(-1, 0), window_attn_skip_freq=None), 1) is None
    assert layer_window(SimpleNamespace(window_size=(0, 0), window_attn_skip_freq=None), 1) == 0  # itself only
    assert layer_window(SimpleNamespace(window_size=(4, 0)), 2) == 4  # a config without the skip frequency
    every_third = SimpleNamespace(window_size=(4, 0), window_attn_skip_freq=3)
    assert [layer_window(every_third, layer) for layer in (1, 2, 3, 4)] == [4, 4, None, 4]
    with pytest.raises(ValueError, match=r"window_size=\(4, 2\) lets a token see 2 later ones"):
        layer_window(SimpleNamespace(window_size=(4, 2), window_attn_skip_freq=None), 1)


def test_a_sink_the_core_does_not_hold_is_refused_whole():
    from types import SimpleNamespace

    from megatron_rl_patches.shared_prefix.kinds.windows_sinks import attention_sink

    class Core:
        config = SimpleNamespace(softmax_type="learnable")

    assert attention_sink(SimpleNamespace(config=SimpleNamespace(softmax_type="vanilla"))) is None
    with pytest.raises(ValueError, match=r"^shared prefix: softmax_type='learnable' but the core attention object "
                                         r"holds no softmax_offset tensor the plan can read; run this model without "
                                         r"a sharing plan$"):
        attention_sink(Core())
