"""build_inference_model refuses a provider that hands it a DDP-wrapped model (megatron-core's or
torch's) or parameters already tied to a DDP grad buffer, and leaves that model as it was."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.megatron


def _megatron_ddp(env):
    return env.ddp(env.gpt(seed=1))


def _torch_ddp(env):
    return torch.nn.parallel.DistributedDataParallel(env.gpt(seed=2))


def _unwrapped_after_ddp(env):
    return env.ddp(env.gpt(seed=3)).module  # the bare model, its parameters still carry main_grad


@pytest.mark.parametrize(
    "make, found",
    [
        (_megatron_ddp, r"megatron\.core\.distributed\.distributed_data_parallel\.DistributedDataParallel"),
        (_torch_ddp, r"torch\.nn\.parallel\.distributed\.DistributedDataParallel"),
        (_unwrapped_after_ddp, r"parameters carry main_grad"),
    ],
)
def test_a_provider_returning_a_ddp_model_is_refused(megatron_cpu, make, found):
    from megatron_rl_patches import build_inference_model

    returned = []

    def provider(pre_process=True, post_process=True):
        model = make(megatron_cpu)
        returned.append((model, {k: v.detach().clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}))
        return model

    with pytest.raises(TypeError, match=rf"model_provider returned .*{found}.*return the bare model"):
        build_inference_model(provider)
    ((model, before),) = returned
    after = {k: v for k, v in model.state_dict().items() if torch.is_tensor(v)}
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    assert all(p.requires_grad for p in model.parameters())  # not frozen: the model is not ours
    assert not getattr(model, "_mrp_inference_only", False)


def test_a_teacher_layout_is_refused_before_the_provider_runs():
    """A model provider builds in parallel_state's groups: build_inference_model(layout=...) is
    refused by name, naming the builder that serves a layout, and the provider never runs."""
    from megatron_rl_patches import build_inference_model
    from megatron_rl_patches.inference import TeacherLayout

    calls = []
    words = "a teacher at its own layout is built from a Hugging Face checkpoint only"
    with pytest.raises(ValueError, match=rf"layout=TeacherLayout\(tp=2.*{words} \(build_inference_model_from_hf"):
        build_inference_model(lambda *args, **kwargs: calls.append(args), layout=TeacherLayout(tp=2))
    assert calls == []
