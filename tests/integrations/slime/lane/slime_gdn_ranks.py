"""Ranks of the slime lane's gated-delta-net worlds: a tiny Qwen3.5- or Qwen3-Next-shaped hybrid built
from slime's own layer spec (`slime_plugins.models.qwen3_5.get_qwen3_5_spec` / `qwen3_next.
get_qwen3_next_spec`: 3 of slime's gated-delta-net `Attention(HuggingfaceAttention)` layers, then one
full-attention layer), its full-attention layers on the kit's packed-input core (Transformer
Engine's stands there on CPU) and flash-linear-attention's three names on transformers' torch code
(slime_fla_cpu.py). The layer reads its Hugging Face config from `--hf-checkpoint`: a tiny one."""
from __future__ import annotations

import contextlib
import copy
import json
import os
import sys
from collections.abc import Iterator
from typing import Any

import torch

HERE = os.path.dirname(__file__)
TESTS = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
KINDS = ("qwen3_5", "qwen3_next")
LAYERS = 4  # 3 gated delta nets, then full attention (Qwen3.5's interval)
VOCAB = 64
TEXT = dict(hidden_size=32, num_hidden_layers=LAYERS, full_attention_interval=4, linear_num_value_heads=4,
            linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
            hidden_act="silu", rms_norm_eps=1e-6, num_attention_heads=4, num_key_value_heads=4, head_dim=8,
            vocab_size=VOCAB, intermediate_size=64, max_position_embeddings=256, dtype="float32")


def write_hf_config(root: str, kind: str) -> str:
    """A tiny Qwen3.5 (vision-language wrapper around its text config, as slime reads it) or
    Qwen3-Next config.json in `root`/kind; returns the directory."""
    path = os.path.join(root, kind)
    os.makedirs(path, exist_ok=True)
    layer_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(LAYERS)]
    text = {**TEXT, "layer_types": layer_types}
    config = ({"model_type": "qwen3_5", "text_config": {**text, "model_type": "qwen3_5_text"}} if kind == "qwen3_5"
              else {**text, "model_type": "qwen3_next"})
    written = os.path.join(path, f"config.json.{os.getpid()}")  # then renamed: ranks write it at once
    with open(written, "w") as f:
        json.dump(config, f)
    os.replace(written, os.path.join(path, "config.json"))
    return path


@contextlib.contextmanager
def gdn_lane_rank(rank: int, world_size: int, tensor: int = 1, context: int = 1,
                  recurrence: str = "chunk") -> Iterator[Any]:
    """The lane's rank setup with transformers real (slime's layer imports it) and fla on CPU
    (`recurrence`: slime_fla_cpu.install's); slime's model kinds registered, as slime's door does
    (these hand-written passes plan slime's layers without it)."""
    for path in (HERE, TESTS):
        if path not in sys.path:
            sys.path.insert(0, path)
    import slime_fla_cpu
    import slime_ranks
    import transformers.models.qwen3_next.modeling_qwen3_next  # noqa: F401  (before fla's stand-in)

    from megatron_rl_patches.integrations.slime.model_kinds import register_model_kinds

    slime_fla_cpu.install(recurrence)
    register_model_kinds()
    with slime_ranks.lane_rank(rank, world_size, tensor=tensor, context=context) as patch:
        yield patch


def slime_spec(kind: str, args: Any, config: Any, vp_stage: Any = None) -> Any:
    """slime's own spec for `kind`, its decoder block megatron-core's local one with the kit's packed
    core attention (slime asks Transformer Engine's; at context parallelism the kit's zigzag one)."""
    import importlib

    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer.spec_utils import ModuleSpec

    from megatron_rl_patches.testing.cp_attention import ContextParallelAttention
    from megatron_rl_patches.testing.packed_gpt import packed_attention_class

    module = importlib.import_module(f"slime_plugins.models.{kind}")
    core = (packed_attention_class() if config.context_parallel_size == 1
            else ModuleSpec(module=ContextParallelAttention, params={"layout": "zigzag"}))

    def local_block(config: Any, use_transformer_engine: bool = True, **kwargs: Any) -> Any:
        block = gpt_layer_specs.get_gpt_decoder_block_spec(config, use_transformer_engine=False, **kwargs)
        block = copy.deepcopy(block)
        for layer in block.layer_specs:
            layer.submodules.self_attention.submodules.core_attention = core
        return block

    real = module.get_gpt_decoder_block_spec
    module.get_gpt_decoder_block_spec = local_block
    try:
        return getattr(module, f"get_{kind}_spec")(args, config, vp_stage)
    finally:
        module.get_gpt_decoder_block_spec = real


def slime_hybrid(kind: str, args: Any, config: Any, pre_process: bool = True, post_process: bool = True,
                 vp_stage: Any = None, seed: int = 3) -> Any:
    """The tiny hybrid GPTModel from slime's spec (every parameter drawn from `seed`)."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    torch.manual_seed(seed)
    model = GPTModel(config=config, transformer_layer_spec=slime_spec(kind, args, config, vp_stage),
                     vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
                     position_embedding_type="rope", pre_process=pre_process, post_process=post_process,
                     vp_stage=vp_stage)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # slime's layers start at ones / zeros / fla's init: every parameter drawn
        for name, p in model.named_parameters():
            if "linear_attn" in name or "input_layernorm" in name:
                p.copy_(p + 0.3 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return model


def hybrid_provider(kind: str, path: str) -> Any:
    """Stands for slime's `get_model_provider_func` (as slime_kit.provider_func): the tiny hybrid of
    `kind` from slime's spec, --hf-checkpoint `path`."""

    def provider_func(args: Any, role: str = "actor") -> Any:
        from megatron.training.arguments import core_transformer_config_from_args

        args.hf_checkpoint = path

        def provider(pre_process: bool = True, post_process: bool = True, vp_stage: Any = None, config: Any = None,
                     **_: Any) -> Any:
            config = config if config is not None else core_transformer_config_from_args(args)
            return slime_hybrid(kind, args, config, pre_process, post_process, vp_stage)

        return provider

    return provider_func


def planned_and_packed(rank: int, world_size: int, root: str, sequence_parallel: bool = False,
                       dtype: str = "float32") -> dict[str, Any]:
    """Per kind: slime's hybrid over GRPO groups packed whole (thd, slime's path) and under the
    shared-prefix plan: the sample rows' log-probs and entropy, every parameter's gradient of one
    objective, the tokens each embedded; in a world of 2, also "cp2": `planned_at_context_parallelism`'s."""
    from types import SimpleNamespace

    with gdn_lane_rank(rank, world_size, tensor=world_size):
        from kit.shared_prefix import grpo_batch, objective, ordinary, planned, scores
        from megatron.core import parallel_state

        from megatron_rl_patches.shared_prefix import check_shared_prefix
        from megatron_rl_patches.testing.compare import collect_grads
        from megatron_rl_patches.testing.megatron_cpu import tiny_gpt_config

        torch_dtype = getattr(torch, dtype)
        tp_group = parallel_state.get_tensor_model_parallel_group() if world_size > 1 else None
        out: dict[str, Any] = {}
        for kind in KINDS:
            args = SimpleNamespace(hf_checkpoint=write_hf_config(root, kind), num_experts=None,
                                   sequence_parallel=sequence_parallel, padded_vocab_size=VOCAB,
                                   max_position_embeddings=256)
            config = tiny_gpt_config(num_layers=LAYERS, tensor_model_parallel_size=world_size,
                                     sequence_parallel=sequence_parallel, params_dtype=torch_dtype,
                                     pipeline_dtype=torch_dtype)
            model = slime_hybrid(kind, args, config).to(torch_dtype)
            check_shared_prefix(model, training=True)  # nothing refused
            # prompts across the recurrence's 64-row chunk and shorter than the convolution's window
            batch = grpo_batch(((70, (5, 1, 8)), (2, (6, 4))), (9,), padding=2 if world_size == 1 else 3,
                               vocab=VOCAB, seed=7)
            results: dict[str, Any] = {}
            # "again": the ordinary packed call once the model is prepared (no plan: unchanged bit for bit)
            for route, run in (("packed", ordinary), ("planned", planned), ("again", ordinary)):
                model.zero_grad(set_to_none=True)
                embedded: list[int] = []

                def count(module: Any, args: tuple, kwargs: dict, seen: list[int] = embedded) -> None:
                    seen.append(int(kwargs.get("input_ids", args[0] if args else None).numel()))

                hook = model.embedding.register_forward_pre_hook(count, with_kwargs=True)
                kwargs = {"pad_to": world_size} if route == "planned" else {}
                log_probs, entropy = scores(run(model, batch, **kwargs), batch, tp_group=tp_group)
                objective(log_probs, entropy).backward()
                hook.remove()
                results[route] = {"log_probs": log_probs.detach(), "entropy": entropy.detach(),
                                  "grads": collect_grads(model), "embedded": embedded}
            # sequence parallelism: these parameters' gradients are each rank's share of their rows
            results["split_rows"] = sorted(name for name, p in model.named_parameters()
                                           if getattr(p, "sequence_parallel", False))
            out[kind] = results
    if world_size == 2:  # the same world again at CP = 2 (TP = 1)
        out["cp2"] = planned_at_context_parallelism(rank, world_size, root)
    return out


def grpo_rollouts() -> list[dict]:
    """slime_prefix_cases' two rollouts of two GRPO groups of four, at this file's vocabulary and seeds."""
    from slime_prefix_cases import grpo_rollouts as rollouts

    return rollouts(VOCAB, seed_base=50)


def hybrid_train_actor(rank: int, world_size: int, root: str, kind: str, on: bool,
                       flags: tuple[str, ...] = (), pipeline: int = 1) -> dict[str, Any]:
    """slime's real `train_actor` (slime_ranks.opd_train_actor: a reference pass, two snapshot OPD
    teachers, the old log-prob pass and train() over two rollouts) on the tiny hybrid of `kind` from
    slime's spec, MEGATRON_RL_PATCHES_SHARED_PREFIX=1 when `on`; `pipeline` stages (the rest of the
    world tensor-parallel)."""
    for path in (HERE, TESTS):
        if path not in sys.path:
            sys.path.insert(0, path)
    import slime_fla_cpu
    import slime_kit
    import slime_ranks
    import transformers.models.qwen3_next.modeling_qwen3_next  # noqa: F401  (before fla's stand-in)

    slime_fla_cpu.install("token")  # float32-stable under the teacher snapshots' strong decays
    slime_kit.provider_func = hybrid_provider(kind, write_hf_config(root, kind))
    extra = {"shared_prefix": on, "ref": True, "rollouts": grpo_rollouts()}
    return slime_ranks.opd_train_actor(rank, world_size, pipeline, tensor=world_size // pipeline, rollouts=2,
                                       extra=extra,
                                       flags=("--num-layers", str(LAYERS), *flags))


def planned_at_context_parallelism(rank: int, world_size: int, root: str,
                                   runs: tuple = (("zigzag", 0), ("contiguous", 2)),
                                   dtype: str = "float32") -> dict[str, Any]:
    """Per kind: slime's hybrid under a plan at CP = `world_size` (each rank its `layout` share of the
    ids of context_parallel_batches()[index], at CP = 4 context_parallel_batches_of_four()'s, per
    (layout, index) of `runs`) against the same samples
    packed whole at CP = 1 with the same weights: (log-prob error, entropy error, objective error,
    gradient error (summed over the CP ranks), this rank's sample rows, whether the same parameters have
    gradients). The recurrence token by token (slime_fla_cpu.install("token"): float32-stable where the
    plan's chunks start elsewhere than the packed path's)."""
    from types import SimpleNamespace

    from kit.context_parallel_prefix import (
        context_parallel_batches,
        context_parallel_batches_of_four,
        planned_with,
        rank_step,
    )
    from kit.shared_prefix import ordinary, scores

    from megatron_rl_patches.testing.compare import collect_grads, grad_error, relative_error
    from megatron_rl_patches.testing.megatron_cpu import tiny_gpt_config

    batches = context_parallel_batches_of_four() if world_size == 4 else context_parallel_batches()

    def build(kind: str, cp: int) -> Any:
        args = SimpleNamespace(hf_checkpoint=write_hf_config(root, kind), num_experts=None, sequence_parallel=False,
                               padded_vocab_size=VOCAB, max_position_embeddings=256)
        torch_dtype = getattr(torch, dtype)
        config = tiny_gpt_config(num_layers=LAYERS, context_parallel_size=cp, params_dtype=torch_dtype,
                                 pipeline_dtype=torch_dtype)
        return slime_hybrid(kind, args, config).to(torch_dtype)

    want: dict[tuple[str, int], Any] = {}
    with gdn_lane_rank(rank, world_size, recurrence="token"):  # CP = 1: every rank the whole micro-batch
        for kind in KINDS:
            model = build(kind, 1)
            want[kind, -1] = {name: p.detach().clone() for name, p in model.named_parameters()}
            for index in sorted({index for _, index in runs}):
                batch = batches[index]
                log_probs, entropy = scores(ordinary(model, batch), batch)
                weights = torch.randn(2, batch.rows.numel(), generator=torch.Generator().manual_seed(index))
                loss = (weights[0] * log_probs).sum() + (weights[1] * entropy).sum()  # rank_step's objective
                loss.backward()
                want[kind, index] = (log_probs.detach(), entropy.detach(), float(loss), collect_grads(model))
    out: dict[str, Any] = {}
    with gdn_lane_rank(rank, world_size, context=world_size, recurrence="token"):
        from megatron.core import parallel_state

        cp = parallel_state.get_context_parallel_group()
        for kind in KINDS:
            model = planned_with(build(kind, world_size), want[kind, -1])
            for layout, index in runs:
                rows, log_probs, entropy, loss = rank_step(model, batches[index], layout, index, 1, None,
                                                           context_parallel=world_size)
                summed = loss.detach().clone()
                torch.distributed.all_reduce(summed, group=cp)
                want_lp, want_ent, want_loss, want_grads = want[kind, index]
                grads = collect_grads(model, summed_over=cp)
                out[f"{kind}/{layout}/{index}"] = (
                    relative_error(log_probs, want_lp[rows]), relative_error(entropy, want_ent[rows]),
                    abs(float(summed) - want_loss) / max(1.0, abs(want_loss)), grad_error(grads, want_grads),
                    int(rows.numel()), sorted(grads) == sorted(want_grads))
    return out
