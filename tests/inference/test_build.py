"""Inference-only builds on real megatron-core (CPU): no DDP, frozen, eval-locked, same outputs as
a trainable build in eval (the frozen chunks' guards: test_guard.py; the forward-only helper:
test_forward.py; the role switch: test_roles.py; weights-only loading: test_weights.py)."""
from __future__ import annotations

import pytest
import torch

from megatron_rl_patches.testing import layouts

pytestmark = pytest.mark.megatron

DROPOUT = dict(hidden_dropout=0.5, attention_dropout=0.5)


# ---------------------------------------------------------------------------- the build


@layouts.mark("bshd")
def test_inference_build_is_frozen_and_matches_the_trainable_build_in_eval(megatron_cpu_kind, ddp_anywhere):
    from megatron_rl_patches import build_inference_model

    config = megatron_cpu_kind.config(**DROPOUT)
    chunks = build_inference_model(megatron_cpu_kind.model_provider(config, seed=4))
    assert len(chunks) == 1
    chunk = chunks[0]
    assert not ddp_anywhere(chunk)
    assert chunk._mrp_inference_only is True
    params = list(chunk.parameters())
    assert params and all(not p.requires_grad for p in params)
    assert all(not hasattr(p, "main_grad") and p.grad is None for p in params)

    trainable = megatron_cpu_kind.ddp(megatron_cpu_kind.model(megatron_cpu_kind.config(**DROPOUT), seed=4))
    assert any(hasattr(p, "main_grad") for p in trainable.parameters())  # the cost we avoid
    trainable.eval()
    batch = megatron_cpu_kind.batch(seed=1)

    chunk.train()  # what slime's forward_only() does after each pass
    assert not any(m.training for m in chunk.modules())
    first = megatron_cpu_kind.forward(chunk, batch)
    second = megatron_cpu_kind.forward(chunk, batch)
    expected = megatron_cpu_kind.forward(trainable, batch)
    # dropout 0.5 would make two train-mode passes differ: equal outputs prove eval mode
    assert torch.equal(first, second)
    assert torch.equal(first, expected)
    assert not first.requires_grad


@layouts.mark("bf16")
def test_bf16_build_is_wrapped_in_float16module(megatron_cpu_kind, ddp_anywhere):
    from megatron.core.transformer.module import Float16Module

    from megatron_rl_patches import build_inference_model

    def bf16():
        return megatron_cpu_kind.config(bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16)

    (chunk,) = build_inference_model(megatron_cpu_kind.model_provider(bf16(), seed=2))
    assert isinstance(chunk, Float16Module) and not ddp_anywhere(chunk)
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in chunk.parameters())
    chunk.train(True)
    assert not chunk.training and not chunk.module.training
    chunk.module.train()  # the inner module is locked too
    assert not chunk.module.training

    reference = Float16Module(bf16(), megatron_cpu_kind.model(bf16(), seed=2)).eval()
    batch = megatron_cpu_kind.batch(seed=3)
    out = megatron_cpu_kind.forward(chunk, batch)
    assert out.dtype == torch.float32
    assert torch.equal(out, megatron_cpu_kind.forward(reference, batch))


def test_explicit_config_decides_the_float16_wrap(megatron_cpu_kind):
    from megatron.core.transformer.module import Float16Module

    from megatron_rl_patches import build_inference_model

    (chunk,) = build_inference_model(
        megatron_cpu_kind.model_provider(seed=0),
        config=megatron_cpu_kind.config(bf16=True, pipeline_dtype=torch.bfloat16),
    )
    assert isinstance(chunk, Float16Module)
    assert all(p.dtype == torch.bfloat16 for p in chunk.parameters())


def test_pipeline_stages_and_vp_stage_passing(megatron_cpu, monkeypatch):
    from megatron.core import parallel_state

    from megatron_rl_patches import build_inference_model

    monkeypatch.setattr(parallel_state, "get_virtual_pipeline_model_parallel_world_size", lambda: 2)
    monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_world_size", lambda *a, **k: 2)
    calls = []

    def modern(pre_process, post_process, vp_stage=None):
        calls.append((pre_process, post_process, vp_stage))
        return torch.nn.Linear(2, 2)

    def legacy(pre_process=True, post_process=True):
        calls.append((pre_process, post_process, parallel_state.get_virtual_pipeline_model_parallel_rank()))
        return torch.nn.Linear(2, 2)

    for rank, expected in ((0, [(True, False, 0), (False, False, 1)]), (1, [(False, False, 0), (False, True, 1)])):
        monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_rank", lambda *a, rank=rank, **k: rank)
        for provider in (modern, legacy):
            calls.clear()
            chunks = build_inference_model(provider)
            assert calls == expected, (provider.__name__, rank)
            assert len(chunks) == 2 and all(c._mrp_inference_only for c in chunks)
    assert parallel_state.get_virtual_pipeline_model_parallel_rank() is None  # restored


def test_build_rejects_bad_providers(megatron_cpu):
    from megatron_rl_patches import build_inference_model

    with pytest.raises(TypeError, match="model_provider must be callable"):
        build_inference_model("gpt")
    with pytest.raises(TypeError, match="must return a torch.nn.Module"):
        build_inference_model(lambda pre_process, post_process: {"not": "a module"})


def test_build_needs_model_parallel_state():
    pytest.importorskip("megatron.core")
    from megatron_rl_patches import build_inference_model

    with pytest.raises(RuntimeError, match="initialize_model_parallel"):
        build_inference_model(lambda pre_process, post_process: torch.nn.Linear(2, 2))
