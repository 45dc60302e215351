"""The `inference_roles` patch on the stand-in slime (tests/standins/slime) and real megatron-core
(CPU): listed roles built inference-only with weights-only loading, other roles upstream's way."""
from __future__ import annotations

import argparse

import pytest
import torch

pytestmark = pytest.mark.megatron


@pytest.fixture
def slime_modules(slime_standin):
    """The stand-in's model and checkpoint modules, freshly imported."""
    import slime.backends.megatron_utils.checkpoint as checkpoint
    import slime.backends.megatron_utils.model as model

    return model, checkpoint


def test_role_switch_builds_listed_roles_inference_only(megatron_cpu, slime_modules, tmp_path, monkeypatch, weights_kit,
                                                        ddp_anywhere):
    from megatron.core.distributed import DistributedDataParallel

    import megatron_rl_patches

    model_module, checkpoint = slime_modules
    monkeypatch.delenv("MEGATRON_RL_PATCHES_INFERENCE_ROLES", raising=False)
    teacher = megatron_cpu.gpt(seed=71)
    weights_kit.save(teacher, tmp_path / "teacher", iteration=9)
    args = argparse.Namespace(load=str(tmp_path / "teacher"), bf16=False, seed=72, finetune=False)
    checkpoint.ARGS = args

    statuses = megatron_rl_patches.apply(only="inference_roles", strict=True)
    # the build, and slime's forward_only (a role at its own layout); the actor's bound name: not imported yet
    assert [(s.target.rpartition(".")[2], s.status) for s in statuses] == [
        ("model:initialize_model_and_optimizer", "applied"), ("model:forward_only", "applied"),
        ("actor:forward_only", "pending")]

    model, optimizer, scheduler, iteration = model_module.initialize_model_and_optimizer(args, role="teacher")
    assert (optimizer, scheduler, iteration) == (None, None, 9)
    assert isinstance(model, list) and len(model) == 1 and model[0].role == "teacher"
    assert model[0]._mrp_inference_only and not ddp_anywhere(model[0])
    assert all(not p.requires_grad for p in model[0].parameters())
    weights_kit.assert_same(weights_kit.state(model[0]), weights_kit.state(teacher))
    assert checkpoint.CALLS == []  # the upstream loader (optimizer, RNG) never ran

    model, optimizer, _, iteration = model_module.initialize_model_and_optimizer(args)  # actor: upstream
    assert isinstance(model[0], DistributedDataParallel) and optimizer.kind == "optimizer" and iteration == 0
    assert len(checkpoint.CALLS) == 1

    monkeypatch.setenv("MEGATRON_RL_PATCHES_INFERENCE_ROLES", "ref, prm_teacher")
    model, optimizer, _, _ = model_module.initialize_model_and_optimizer(args, "teacher")  # no longer listed
    assert isinstance(model[0], DistributedDataParallel) and optimizer is not None

    # a role's own load dir wins over args.load; finetune reports iteration 0 like Megatron-LM
    prm = megatron_cpu.gpt(seed=73)
    torch.save(prm.state_dict(), tmp_path / "prm.pt")
    args.prm_teacher_load, args.finetune = str(tmp_path / "prm.pt"), True
    model, optimizer, _, iteration = model_module.initialize_model_and_optimizer(args, role="prm_teacher")
    assert optimizer is None and iteration == 0
    weights_kit.assert_same(weights_kit.state(model[0]), weights_kit.state(prm))

    megatron_rl_patches.revert()
    model, optimizer, _, _ = model_module.initialize_model_and_optimizer(args, role="ref")
    assert isinstance(model[0], DistributedDataParallel) and optimizer is not None


def test_role_switch_bf16_and_non_megatron_dirs(megatron_cpu, slime_modules, tmp_path, monkeypatch):
    from megatron.core.transformer.module import Float16Module

    import megatron_rl_patches

    model_module, checkpoint = slime_modules
    monkeypatch.setenv("MEGATRON_RL_PATCHES_INFERENCE_ROLES", "teacher")
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    args = argparse.Namespace(load=str(tmp_path / "actor"), teacher_load=str(hf), bf16=True, seed=81)
    checkpoint.ARGS = args
    megatron_rl_patches.apply(only="inference_roles", strict=True)

    model, optimizer, scheduler, iteration = model_module.initialize_model_and_optimizer(args, role="teacher")
    assert isinstance(model[0], Float16Module) and model[0]._mrp_inference_only
    assert (optimizer, scheduler, iteration) == (None, None, 0)
    # a HuggingFace directory goes through the framework's own loader, with no optimizer
    ((load_path, chunks, opt, sched),) = checkpoint.CALLS
    assert load_path == str(hf) and chunks is model and opt is None and sched is None
    assert args.load == str(tmp_path / "actor")  # restored

    args.teacher_load = str(tmp_path / "missing")  # a missing path is ours to report, not upstream's
    with pytest.raises(FileNotFoundError, match="missing"):
        model_module.initialize_model_and_optimizer(args, role="teacher")
    assert len(checkpoint.CALLS) == 1

    del args.teacher_load, args.load
    with pytest.raises(ValueError, match="no weights to load: set args.teacher_load or args.load"):
        model_module.initialize_model_and_optimizer(args, role="teacher")


def _actor_shape_args(**values):
    """slime's actor arguments of the model tiny_hf_config("qwen3") describes (hidden 32, 2 layers)."""
    return argparse.Namespace(hidden_size=32, num_layers=2, num_attention_heads=4, group_query_attention=True,
                              num_query_groups=2, kv_channels=8, ffn_hidden_size=48, vocab_size=1001,
                              qk_layernorm=True, untie_embeddings_and_output_weights=True, bf16=False,
                              params_dtype=torch.float32, transformer_impl="local", seed=91, **values)


def test_a_hugging_face_role_of_another_architecture_is_built_from_its_config(megatron_cpu, slime_modules, tmp_path,
                                                                             monkeypatch):
    """issue 41: a PRM teacher's HF directory of another size was handed to slime's loader with the
    actor's provider (the actor's shapes); now it is built from its own config.json, by role."""
    import megatron_rl_patches
    from megatron_rl_patches.inference.residency.placement import residency_of
    from megatron_rl_patches.testing.hf_checkpoints import tiny_hf_config, write_tiny_checkpoint

    model_module, checkpoint = slime_modules
    monkeypatch.setenv("MEGATRON_RL_PATCHES_INFERENCE_ROLES", "prm_teacher:stream")
    tensors = write_tiny_checkpoint(tmp_path / "prm", tiny_hf_config("qwen3", hidden_size=48, num_hidden_layers=4),
                                    seed=5)
    args = _actor_shape_args(load=str(tmp_path / "actor"), prm_teacher_load=str(tmp_path / "prm"))
    checkpoint.ARGS = args
    megatron_rl_patches.apply(only="inference_roles", strict=True)

    model, optimizer, scheduler, iteration = model_module.initialize_model_and_optimizer(args, role="prm_teacher")
    assert (optimizer, scheduler, iteration) == (None, None, 0) and checkpoint.CALLS == []
    (chunk,) = model
    assert chunk.role == "prm_teacher" and chunk._mrp_inference_only and residency_of(model).mode == "stream"
    assert len(chunk.decoder.layers) == 4 and chunk.hf_vocab_size == 1001
    assert torch.equal(chunk.embedding.word_embeddings.weight[:1001], tensors["model.embed_tokens.weight"])

    write_tiny_checkpoint(tmp_path / "prm999", tiny_hf_config("qwen3", hidden_size=48, vocab_size=999))
    args.prm_teacher_load = str(tmp_path / "prm999")
    with pytest.raises(ValueError, match="role 'prm_teacher': teacher .*prm999' has vocab_size=999 but the student "
                                         "has vocab_size=1001"):
        model_module.initialize_model_and_optimizer(args, role="prm_teacher")
    assert checkpoint.CALLS == []

    # slime's --allgather-cp with context parallelism: contiguous slices, which megatron-core's thd RoPE
    # would cut in zigzag: refused by name before the role is built (one context-parallel rank: built)
    args.prm_teacher_load, args.allgather_cp, args.context_parallel_size = str(tmp_path / "prm"), True, 2
    with pytest.raises(ValueError, match="role 'prm_teacher'.*not served with --allgather-cp"):
        model_module.initialize_model_and_optimizer(args, role="prm_teacher")
    args.context_parallel_size = 1
    model, *_ = model_module.initialize_model_and_optimizer(args, role="prm_teacher")
    assert len(model[0].decoder.layers) == 4 and checkpoint.CALLS == []
