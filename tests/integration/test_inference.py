"""Inference-only builds on real megatron-core (CPU): no DDP, frozen, eval-locked, same outputs as
a trainable build in eval; forward-only helper; the role-switch patch (weights-only loading:
tests/inference/test_weights.py)."""
from __future__ import annotations

import argparse
import copy
import sys
import textwrap

import pytest
import torch

pytestmark = pytest.mark.megatron

DROPOUT = dict(hidden_dropout=0.5, attention_dropout=0.5)


def _ddp_anywhere(chunk) -> bool:
    from megatron.core.distributed import DistributedDataParallel

    ddp_types = (DistributedDataParallel, torch.nn.parallel.DistributedDataParallel)
    return any(isinstance(m, ddp_types) for m in chunk.modules())


# ---------------------------------------------------------------------------- the build


def test_inference_build_is_frozen_and_matches_the_trainable_build_in_eval(megatron_cpu_kind):
    from megatron_rl_patches import build_inference_model

    config = megatron_cpu_kind.config(**DROPOUT)
    chunks = build_inference_model(megatron_cpu_kind.model_provider(config, seed=4))
    assert len(chunks) == 1
    chunk = chunks[0]
    assert not _ddp_anywhere(chunk)
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


def test_bf16_build_is_wrapped_in_float16module(megatron_cpu_kind):
    from megatron.core.transformer.module import Float16Module

    from megatron_rl_patches import build_inference_model

    def bf16():
        return megatron_cpu_kind.config(bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16)

    (chunk,) = build_inference_model(megatron_cpu_kind.model_provider(bf16(), seed=2))
    assert isinstance(chunk, Float16Module) and not _ddp_anywhere(chunk)
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


def test_frozen_chunks_refuse_training_paths_and_survive_copies(megatron_cpu_kind):
    from megatron.core.distributed import finalize_model_grads

    from megatron_rl_patches import build_inference_model
    from megatron_rl_patches.inference import InferenceOnlyError, assert_trainable, is_inference_only

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


# ---------------------------------------------------------------------------- forward-only helper


def _logits_step(data_iterator, model):
    batch = next(data_iterator)
    from megatron_rl_patches.testing.megatron_cpu import gpt_forward

    return gpt_forward(model, batch), batch["labels"]


def test_inference_forward_returns_logits_and_log_probs(megatron_cpu_kind):
    from megatron_rl_patches import build_inference_model
    from megatron_rl_patches.inference import inference_forward, token_log_probs

    chunks = build_inference_model(megatron_cpu_kind.model_provider(seed=61))
    batches = [megatron_cpu_kind.batch(seed=i) for i in range(3)]
    sizes = dict(num_microbatches=3, seq_length=16, micro_batch_size=2)

    logits = inference_forward(chunks, iter(batches), _logits_step, **sizes)
    assert len(logits) == 3
    for out, batch in zip(logits, batches):
        assert torch.equal(out, megatron_cpu_kind.forward(chunks[0], batch))
        assert not out.requires_grad

    temperature = 0.7
    collect = token_log_probs(temperature=temperature, with_entropy=True)
    results = inference_forward(chunks, iter(batches), _logits_step, collect=collect, **sizes)
    for result, out, batch in zip(results, logits, batches):
        reference = torch.log_softmax(out.double() / temperature, dim=-1)
        expected = reference.gather(-1, batch["labels"].unsqueeze(-1)).squeeze(-1)
        entropy = -(reference.exp() * reference).sum(-1)
        assert result["log_probs"].shape == batch["labels"].shape
        torch.testing.assert_close(result["log_probs"].double(), expected, rtol=0, atol=2e-6)
        torch.testing.assert_close(result["entropy"].double(), entropy, rtol=0, atol=2e-6)

    with pytest.raises(ValueError, match="num_microbatches must be a positive int"):
        inference_forward(chunks, iter(batches), _logits_step, num_microbatches=0, seq_length=16, micro_batch_size=2)
    with pytest.raises(TypeError, match="needs the target token ids"):
        inference_forward(
            chunks,
            iter(batches),
            lambda it, m: megatron_cpu_kind.forward(m, next(it)),
            collect=token_log_probs(),
            **sizes,
        )


# ---------------------------------------------------------------------------- memory report on a real model


def test_memory_formula_matches_counted_grad_buffer_up_to_named_padding(megatron_cpu_kind):
    from megatron_rl_patches import build_inference_model, training_state_bytes
    from megatron_rl_patches.presentation import memory_report as format_report

    model = megatron_cpu_kind.model(seed=0)
    n = sum(p.numel() for p in model.parameters())

    plain = training_state_bytes(megatron_cpu_kind.ddp(model))
    assert plain.num_params == n and plain.dp == 1 and not plain.distributed_optimizer
    assert (plain.param_dtype, plain.grad_dtype) == ("fp32", "fp32")
    assert plain.counted_grad_buffer == plain.grad_buffer == 4 * n  # no padding without the dist. optimizer
    assert plain.grad_buffer_padding == 0 and sum(plain.padding.values()) == 0
    assert plain.main_params == 0 and plain.adam_m == plain.adam_v == 4 * n and plain.total == 12 * n

    flags = dict(use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=4000)
    sharded = training_state_bytes(megatron_cpu_kind.ddp(megatron_cpu_kind.model(seed=0), **flags))
    assert sharded.distributed_optimizer and sharded.grad_buffer == 4 * n
    assert sharded.grad_buffer_padding > 0
    assert sharded.counted_grad_buffer - sharded.grad_buffer == sum(sharded.padding.values())
    assert all(value >= 0 for value in sharded.padding.values())
    assert sharded.padding["bucket end (multiple of lcm(dp, 128))"] > 0
    text = format_report(sharded)
    assert "padding" in text and f"{sharded.grad_buffer_padding:,} B" in text

    config = megatron_cpu_kind.config(bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16)
    from megatron.core.transformer.module import Float16Module

    wrapped = Float16Module(config, megatron_cpu_kind.model(config, seed=0))
    ddp16 = megatron_cpu_kind.ddp(wrapped, grad_reduce_in_fp32=True)
    bf16 = training_state_bytes(ddp16)
    assert (bf16.param_dtype, bf16.grad_dtype) == ("bf16", "fp32") and bf16.total == 16 * n
    assert bf16.counted_grad_buffer == 4 * n

    # the shared chunk helpers on real wrappers: both DDP checks hold on DDP only, unwrap strips both
    from megatron_rl_patches._chunks import has_grad_buffers, is_ddp_like, iter_wrapped, unwrap

    assert is_ddp_like(ddp16) and has_grad_buffers(ddp16)
    assert not is_ddp_like(wrapped) and not has_grad_buffers(wrapped)
    chain = [type(m).__name__ for m in iter_wrapped(ddp16)]
    model_class = {"gpt": "GPTModel", "hybrid": "HybridModel"}[megatron_cpu_kind.kind]
    assert chain == ["DistributedDataParallel", "Float16Module", model_class]
    assert unwrap(ddp16) is wrapped.module and unwrap(wrapped.module) is wrapped.module

    frozen = build_inference_model(megatron_cpu_kind.model_provider(config, seed=0))
    estimate = training_state_bytes(frozen)  # what training this build would add
    assert estimate.num_params == n and estimate.param_dtype == "bf16" and estimate.counted_grad_buffer is None
    assert not is_ddp_like(frozen[0]) and unwrap(frozen[0]) is frozen[0].module  # no DDP hooks to toggle
    frozen_ddp = megatron_cpu_kind.ddp(frozen[0].module)
    assert training_state_bytes(frozen_ddp).num_params == 0  # DDP of a frozen model: no buffer

    with pytest.raises(ValueError, match="dp=8 contradicts the DDP model"):
        training_state_bytes(megatron_cpu_kind.ddp(megatron_cpu_kind.model(seed=0)), dp=8)


# ---------------------------------------------------------------------------- the role switch


STANDIN = {
    "slime/__init__.py": "",
    "slime/backends/__init__.py": "",
    "slime/backends/megatron_utils/__init__.py": "",
    "slime/backends/megatron_utils/model_provider.py": '''
        """Stand-in for slime's model_provider: get_model_provider_func(args, role) returns a
        Megatron-LM style provider (here a tiny GPT on CPU)."""
        import torch
        from megatron_rl_patches.testing.megatron_cpu import build_tiny_gpt, tiny_gpt_config


        def get_model_provider_func(args, role="actor"):
            def model_provider(pre_process=True, post_process=True, vp_stage=None):
                dtype = torch.bfloat16 if args.bf16 else torch.float32
                config = tiny_gpt_config(bf16=args.bf16, params_dtype=dtype, pipeline_dtype=dtype)
                return build_tiny_gpt(config, pre_process=pre_process, post_process=post_process, seed=args.seed)

            return model_provider
    ''',
    "slime/backends/megatron_utils/checkpoint.py": '''
        """Stand-in for slime's checkpoint module: load_checkpoint reads args.load (slime reads
        get_args().load) and would use megatron-bridge for a HuggingFace directory."""
        CALLS = []
        ARGS = None


        def load_checkpoint(
            ddp_model, optimizer, opt_param_scheduler, checkpointing_context, skip_load_to_model_and_opt
        ):
            CALLS.append((ARGS.load, ddp_model, optimizer, opt_param_scheduler))
            return 0, 0
    ''',
    "slime/backends/megatron_utils/model.py": '''
        """Stand-in for slime.backends.megatron_utils.model, same structure and signature:
        initialize_model_and_optimizer(args, role="actor") -> (model, optimizer, scheduler, iteration)."""
        from types import SimpleNamespace

        from megatron_rl_patches.testing.megatron_cpu import wrap_ddp

        from .checkpoint import load_checkpoint
        from .model_provider import get_model_provider_func


        def setup_model_and_optimizer(args, role="actor"):
            model = [wrap_ddp(get_model_provider_func(args, role)())]
            return model, SimpleNamespace(kind="optimizer"), SimpleNamespace(kind="scheduler")


        def initialize_model_and_optimizer(args, role: str = "actor"):
            model, optimizer, opt_param_scheduler = setup_model_and_optimizer(args, role)
            setattr(model[0], "role", role)
            iteration, _ = load_checkpoint(model, optimizer, opt_param_scheduler, {}, False)
            return model, optimizer, opt_param_scheduler, iteration
    ''',
}


@pytest.fixture
def slime_standin(tmp_path):
    root = tmp_path / "standin"
    for name, text in STANDIN.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    sys.path.insert(0, str(root))
    try:
        import slime.backends.megatron_utils.checkpoint as checkpoint
        import slime.backends.megatron_utils.model as model

        yield model, checkpoint
    finally:
        sys.path.remove(str(root))
        for name in [m for m in sys.modules if m == "slime" or m.startswith("slime.")]:
            del sys.modules[name]


def test_role_switch_builds_listed_roles_inference_only(megatron_cpu, slime_standin, tmp_path, monkeypatch, weights_kit):
    import megatron_rl_patches
    from megatron.core.distributed import DistributedDataParallel

    model_module, checkpoint = slime_standin
    monkeypatch.delenv("MEGATRON_RL_PATCHES_INFERENCE_ROLES", raising=False)
    teacher = megatron_cpu.gpt(seed=71)
    weights_kit.save(teacher, tmp_path / "teacher", iteration=9)
    args = argparse.Namespace(load=str(tmp_path / "teacher"), bf16=False, seed=72, finetune=False)
    checkpoint.ARGS = args

    statuses = megatron_rl_patches.apply(only="inference_roles", strict=True)
    assert [s.status for s in statuses] == ["applied"]

    model, optimizer, scheduler, iteration = model_module.initialize_model_and_optimizer(args, role="teacher")
    assert (optimizer, scheduler, iteration) == (None, None, 9)
    assert isinstance(model, list) and len(model) == 1 and model[0].role == "teacher"
    assert model[0]._mrp_inference_only and not _ddp_anywhere(model[0])
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


def test_role_switch_bf16_and_non_megatron_dirs(megatron_cpu, slime_standin, tmp_path, monkeypatch):
    import megatron_rl_patches
    from megatron.core.transformer.module import Float16Module

    model_module, checkpoint = slime_standin
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
