"""The frozen chunks an inference-only build returns (real megatron-core on CPU): training paths
refused with a named error, hook toggles no-ops, the eval lock surviving copies."""
from __future__ import annotations

import copy

import pytest
import torch

pytestmark = pytest.mark.megatron


def test_frozen_chunks_refuse_training_paths_and_survive_copies(megatron_cpu_kind):
    from megatron.core.distributed import finalize_model_grads

    from megatron_rl_patches import build_inference_model
    from megatron_rl_patches.inference import InferenceOnlyError, assert_trainable

    (chunk,) = build_inference_model(megatron_cpu_kind.model_provider(seed=0))
    with pytest.raises(InferenceOnlyError, match="inference-only"):
        assert_trainable([chunk])
    with pytest.raises(TypeError, match="chunk 1"):  # InferenceOnlyError is a TypeError
        assert_trainable([megatron_cpu_kind.model(), chunk])
    assert_trainable([megatron_cpu_kind.ddp(megatron_cpu_kind.model())])  # trainable chunks pass
    with pytest.raises(InferenceOnlyError, match="zero_grad_buffer"):
        chunk.zero_grad_buffer()
    with pytest.raises(InferenceOnlyError, match="finish_grad_sync"):
        finalize_model_grads([chunk])  # megatron-core's grad sync meets a frozen chunk
    assert chunk.disable_forward_pre_hook() is None  # no hooks: toggling is a no-op, twice
    assert chunk.disable_forward_pre_hook(param_sync=False) is None
    assert chunk.enable_forward_pre_hook() is None


def test_the_eval_lock_survives_deepcopy_and_pickle():
    # (megatron's GPTModel holds process groups, which cannot be copied: a plain module here)
    import pickle

    from megatron_rl_patches.inference.guard import freeze_chunk, is_inference_only

    chunk = freeze_chunk(torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Dropout(0.5)))
    for clone in (copy.deepcopy(chunk), pickle.loads(pickle.dumps(chunk))):
        assert is_inference_only(clone)
        clone.train()
        assert not any(m.training for m in clone.modules())
        assert all(not p.requires_grad for p in clone.parameters())
        assert clone.train.args[0] is clone  # the copy's lock acts on the copy
        x = torch.ones(4, 3)
        assert torch.equal(clone(x), clone(x))
