"""`MEGATRON_RL_PATCHES_INFERENCE_ROLES=prm_teacher:stream,teacher:swap`: the roles patch (stand-in
slime, real megatron-core on CPU) builds each listed role with its residency, the weights loaded
into host memory, outputs equal to the saved model's; the grammar's errors name the variable."""
from __future__ import annotations

import argparse

import pytest
import torch

from megatron_rl_patches.patching import env

pytestmark = pytest.mark.megatron


def test_roles_get_their_residency(megatron_cpu, slime_standin, tmp_path, monkeypatch, weights_kit):
    import slime.backends.megatron_utils.checkpoint as checkpoint
    import slime.backends.megatron_utils.model as model_module

    import megatron_rl_patches
    from megatron_rl_patches import residency_report
    from megatron_rl_patches.inference.residency.storage import device_weight_bytes

    teacher = megatron_cpu.gpt(seed=71).eval()
    weights_kit.save(teacher, tmp_path / "teacher", iteration=9)
    prm = megatron_cpu.gpt(seed=73).eval()
    torch.save(prm.state_dict(), tmp_path / "prm.pt")
    args = argparse.Namespace(load=str(tmp_path / "teacher"), prm_teacher_load=str(tmp_path / "prm.pt"), bf16=False,
                              seed=72, finetune=False)
    checkpoint.ARGS = args
    monkeypatch.setenv("MEGATRON_RL_PATCHES_INFERENCE_ROLES", "prm_teacher:stream, teacher:swap, ref")
    megatron_rl_patches.apply(only="inference_roles", strict=True)
    batch = megatron_cpu.batch(seed=5)
    for role, source, residency, iteration in (("teacher", teacher, "swap", 9), ("prm_teacher", prm, "stream", 0),
                                               ("ref", teacher, "resident", 9)):
        model, optimizer, _, got_iteration = model_module.initialize_model_and_optimizer(args, role=role)
        assert optimizer is None and got_iteration == iteration and model[0].role == role
        assert residency_report(model).mode == residency
        if residency != "resident":
            assert device_weight_bytes(model[0].parameters()) == 0
        assert torch.equal(megatron_cpu.forward(model[0], batch), megatron_cpu.forward(source, batch))
    assert checkpoint.CALLS == []


def test_load_after_a_stream_build_writes_the_host_copies(megatron_cpu, tmp_path):
    from megatron_rl_patches import build_inference_model, hold, load_inference_weights
    from megatron_rl_patches.inference.residency.storage import device_weight_bytes

    source = megatron_cpu.gpt(seed=11).eval()
    torch.save(source.state_dict(), tmp_path / "w.pt")
    chunks = build_inference_model(megatron_cpu.model_provider(seed=0), residency="stream")
    load_inference_weights(chunks, tmp_path / "w.pt")
    assert device_weight_bytes(chunks[0].parameters()) == 0  # loaded into the host copies
    batch = megatron_cpu.batch(seed=6)
    assert torch.equal(megatron_cpu.forward(chunks[0], batch), megatron_cpu.forward(source, batch))
    with hold(chunks[0].decoder.layers[0]), pytest.raises(RuntimeError, match="cannot load weights into .* layer0"):
        load_inference_weights(chunks, tmp_path / "w.pt")


def test_role_grammar():
    value = {env.INFERENCE_ROLES: "prm_teacher:stream, teacher:SWAP,ref"}
    assert env.checked_role_names(value) == ["prm_teacher", "teacher", "ref"]
    assert env.role_residencies(value) == {"prm_teacher": "stream", "teacher": "swap"}
    assert env.role_residencies({}) == {}


@pytest.mark.parametrize(
    "value, message",
    [
        ("teacher:offload", "role 'teacher' has residency 'offload'; use role:resident|swap|stream"),
        ("teacher:", "role 'teacher' has residency ''"),
        ("te-acher:stream", "'te-acher' is not a role name"),
        (":stream", "'' is not a role name"),
    ],
)
def test_role_grammar_errors_name_the_variable(value, message):
    with pytest.raises(ValueError, match="MEGATRON_RL_PATCHES_INFERENCE_ROLES=") as info:
        env.checked_role_names({env.INFERENCE_ROLES: value})
    assert message in str(info.value)


def test_the_grammar_knows_every_residency():
    from megatron_rl_patches import inference, settings
    from megatron_rl_patches.inference.sizing import residency_plan

    # one definition: the planner, the public name and the roles variable share the leaf's tuple
    modes = settings.RESIDENCY_MODES
    assert residency_plan.MODES is inference.RESIDENCY_MODES is env.RESIDENCY_MODES is modes
    with pytest.raises(ValueError, match="'resident', 'swap', 'stream'"):
        settings.check_residency("streaming")
