"""build_inference_model_from_hf: a frozen teacher (or reference, PRM teacher) from a Hugging Face
checkpoint directory in one call: its architecture from config.json, the model built by
build_inference_model on megatron-core's local spec, its weights from the safetensors files."""
from __future__ import annotations

import inspect
import os
from typing import Any

import torch

import megatron_rl_patches.inference.build as inference_build  # a module: tests guard its build_checked
from megatron_rl_patches.inference.loading.hf import load as hf_load
from megatron_rl_patches.inference.loading.hf import mbridge_adapter
from megatron_rl_patches.inference.loading.hf.checkpoint_config import read_checkpoint_config
from megatron_rl_patches.inference.loading.hf.families import architecture, split_problems
from megatron_rl_patches.inference.loading.hf.memory_plan import hf_memory_plan
from megatron_rl_patches.inference.loading.hf.model import (
    checkpoint_dtype,
    model_provider,
    padded_vocab,
    transformer_config,
)
from megatron_rl_patches.inference.residency.budget import ResidencyBudget
from megatron_rl_patches.inference.residency.placement import check_residency_args
from megatron_rl_patches.inference.teacher_layout.build_args import (
    config_sizes,
    refuse_unserved,
    shard_ranks,
)
from megatron_rl_patches.inference.teacher_layout.groups import check_layout, groups_of_agreed, layout_values
from megatron_rl_patches.inference.teacher_layout.layout import TeacherLayout
from megatron_rl_patches.inference.teacher_layout.own_groups import gather_in_own_groups
from megatron_rl_patches.ops import agreement
from megatron_rl_patches.ops.scoring_plan import positive_int

CONVERTERS = ("builtin", "mbridge")


def _check_parallel(arch: Any, core_attention: type | None, layout: TeacherLayout | None = None) -> None:
    from megatron.core import parallel_state as ps  # lazy: optional dependency megatron-core

    if not ps.model_parallel_is_initialized():
        raise RuntimeError(
            "build_inference_model_from_hf needs megatron-core's model-parallel state: call "
            "megatron.core.parallel_state.initialize_model_parallel(...) first"
        )
    if layout is not None:  # the teacher's own sizes, not the student's
        problems = split_problems(arch, layout.tp, layout.pp, layout.ep, 1)
        if problems:
            world = torch.distributed.get_world_size()  # the layout was checked against it: initialized
            served = [tp for tp in range(1, world + 1) if not world % tp and not split_problems(arch, tp, 1, 1, 1)]
            raise ValueError(f"{arch.source}: layout={layout!r}: {'; '.join(problems)}; choose a layout this model "
                             f"serves (over {world} ranks: tp in {served})")
        return
    tp, pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
    ep = ps.get_expert_model_parallel_world_size()
    vpp = ps.get_virtual_pipeline_model_parallel_world_size() or 1
    problems = split_problems(arch, tp, pp, ep, vpp)
    cp = ps.get_context_parallel_world_size()
    # (the gated delta nets of linear-attention families exchange rows over the context-parallel group)
    if cp > 1 and core_attention is None:  # megatron-core's local attention would see only its own rows
        problems.append(f"context-parallel size {cp} with megatron-core's local attention, which serves context "
                        "parallelism 1 only: pass core_attention= a class that serves it (Transformer Engine's "
                        "TEDotProductAttention)")
    if problems:
        raise ValueError(f"{arch.source}: {'; '.join(problems)}; choose parallel sizes this model serves")


def _check_core_attention(arch: Any, core_attention: type | None) -> None:
    """Multi-latent attention gives its core its own key / value widths (`k_channels` /
    `v_channels`): a core class that does not take them is named before the build."""
    if core_attention is None or getattr(arch, "mla", None) is None:
        return
    try:
        parameters = inspect.signature(core_attention).parameters  # the class: its __init__ without self
    except (TypeError, ValueError):
        return
    if not ({"k_channels", "v_channels"} <= set(parameters)
            or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())):
        raise TypeError(
            f"core_attention={core_attention.__name__} does not take k_channels / v_channels, which {arch.source}'s "
            f"multi-latent attention ({arch.model_type}) gives its attention core: pass a core that takes them "
            "(Transformer Engine's TEDotProductAttention) or None (the SDPA core)"
        )


def _check_budget(root: Any, mode: str, budget: ResidencyBudget | None, dtype: torch.dtype,
                  layout: TeacherLayout | None = None) -> None:
    """A budget smaller than what this rank must hold on the device at once (swap: its whole
    shard; stream: its largest piece, a layer or the embedding / output layer) is refused before
    the build: config.json gives the sizes. At a teacher `layout`: its own sizes, and the stage
    that needs most (the same on every rank, so no rank is left waiting in the build)."""
    if budget is None or mode == "resident":
        return
    from megatron.core import parallel_state as ps  # lazy: optional dependency megatron-core

    if layout is not None:
        plan = hf_memory_plan(root, tp=layout.tp, pp=layout.pp, ep=layout.ep, param_dtype=dtype)
        stages = list(range(plan.pp))
    else:
        plan = hf_memory_plan(root, tp=ps.get_tensor_model_parallel_world_size(),
                              pp=ps.get_pipeline_model_parallel_world_size(),
                              ep=ps.get_expert_model_parallel_world_size(), param_dtype=dtype)
        stages = [ps.get_pipeline_model_parallel_rank()]
    last = plan.pp - 1

    def stage_need(stage: int) -> int:
        pieces = [plan.layer_params, plan.embedding_params if stage == 0 else 0,
                  plan.output_params if stage == last else 0]
        return plan.stage_params[stage] if mode == "swap" else max(pieces)

    need = max(stage_need(stage) for stage in stages) * torch.empty((), dtype=dtype).element_size()
    if need > budget.bytes:
        where = "this rank" if layout is None else f"a rank of layout={layout!r}"
        raise ValueError(
            f"{str(root)!r} does not fit budget={budget!r} with residency={mode!r}: {where} needs {need} device "
            f"bytes at once ({'its whole shard' if mode == 'swap' else 'its largest layer or embedding'}); raise "
            "the budget, use residency='stream', or split the model over more tensor / pipeline ranks"
        )


def build_inference_model_from_hf(
    path: str | os.PathLike[str],
    *,
    residency: str = "resident",
    prefetch: int = 1,
    budget: ResidencyBudget | None = None,
    dtype: Any = None,
    make_vocab_size_divisible_by: int = 128,
    core_attention: type | None = None,
    converter: str = "builtin",
    layout: TeacherLayout | None = None,
) -> list[torch.nn.Module]:
    """Inference-only chunks (see build_inference_model) of the Hugging Face checkpoint directory
    `path` (config.json + *.safetensors; pickle files are never read) at the tensor / pipeline /
    expert parallel sizes of megatron.core.parallel_state. Families: those registered in
    inference/loading/hf/families/ (llama, qwen2, qwen3, qwen3_moe; UnsupportedCheckpointError otherwise).

    `dtype`: the weights' dtype (default: the checkpoint's own, config.json's `dtype`); the vocab
    is padded as Megatron-LM pads it (`make_vocab_size_divisible_by` x TP, zero rows): pass the
    real `vocab_size` (hf_vocab_size(path)) to the ops so the padding gets no probability mass.
    Bad input (a path that is no checkpoint directory, an unserved family, missing, unlisted or
    mis-shaped weight files, a `budget` this rank's pieces cannot fit) is refused before the model
    is built. `core_attention`: the attention core class of the layers (default: megatron-core's
    local one, which refuses packed `thd` batches; e.g. Transformer Engine's TEDotProductAttention
    where a framework packs them, as slime does). It holds no weights: the mapping is the same.
    `converter`: "builtin" (the package's own) or "mbridge" (mbridge 0.15.1's config mapping and
    load_weights behind the adapters of inference/loading/hf/mbridge_adapter.py; the `mbridge` extra).
    `layout`: a TeacherLayout (inference/teacher_layout) to build the teacher at its own
    tensor / pipeline-parallel sizes over all ranks of the default process group, on its own
    process groups (megatron-core >= 0.15), each rank reading only its shard (its stage's layers;
    every family, experts split over the teacher's tensor-parallel group; every residency: a
    swap / stream teacher keeps its own shard in host memory); every rank must call this, and
    scoring goes through score_at_layout / topk_at_layout.
    None: the sizes of parallel_state (the student's).
    """
    if layout is not None:
        return _agreed_layout_build(path, layout, (residency, prefetch, budget), dtype,
                                    make_vocab_size_divisible_by, core_attention, converter)
    checked = _checked(path, (residency, prefetch, budget), dtype, make_vocab_size_divisible_by, core_attention,
                       converter, None)
    root, config_dict, arch, weights_dtype, divisible_by, mode = checked
    from megatron.core import parallel_state as ps  # lazy: optional dependency megatron-core

    vocab = padded_vocab(arch.vocab_size, divisible_by, ps.get_tensor_model_parallel_world_size())
    if converter == "mbridge":
        bridge = mbridge_adapter.mbridge_bridge(config_dict, arch, weights_dtype, vocab)
        provider = model_provider(arch, bridge.config, vocab, core_attention, mbridge_adapter.gpt_args(bridge))
        chunks = inference_build.build_checked(provider, mode, prefetch, budget)
        mbridge_adapter.load_with_mbridge(bridge, chunks, root)
    else:
        provider = model_provider(arch, transformer_config(arch, weights_dtype), vocab, core_attention)
        chunks = inference_build.build_checked(provider, mode, prefetch, budget)
        hf_load.load_hf_weights(chunks, root, arch, vocab)
    for chunk in chunks:
        setattr(chunk, "hf_vocab_size", arch.vocab_size)  # noqa: B010 - the real vocab, for the ops' vocab_size=
    return chunks


def _checked(path: Any, residency: tuple[str, int, ResidencyBudget | None], dtype: Any, divisible: Any,
             core_attention: type | None, converter: str, layout: TeacherLayout | None) -> tuple[Any, ...]:
    """Every check of one rank before the build, nothing built (the checkpoint's config and weight
    index read): (root, config fields, architecture, weights dtype, vocab divisor, residency mode)."""
    if converter not in CONVERTERS:
        raise ValueError(f"converter must be one of {CONVERTERS}, got {converter!r}")
    if converter == "mbridge":
        mbridge_adapter.import_mbridge()  # the missing extra is named before anything is read
    mode = check_residency_args(*residency)
    if core_attention is not None and not isinstance(core_attention, type):
        raise TypeError(f"core_attention must be an attention core class (e.g. TEDotProductAttention) or None, "
                        f"got {type(core_attention).__name__}")
    if layout is not None:
        layout, _ = check_layout(layout)  # the world and megatron-core hold it
    checkpoint = read_checkpoint_config(path)
    root, config_dict = checkpoint.root, checkpoint.fields
    arch = architecture(config_dict, source=str(root))
    weights_dtype = checkpoint_dtype(checkpoint.dtype, dtype)
    divisible_by = positive_int("make_vocab_size_divisible_by", divisible)
    if layout is not None:
        refuse_unserved(layout, arch, converter)
    _check_parallel(arch, core_attention, layout)
    _check_core_attention(arch, core_attention)
    hf_load.checked_index(root, arch)  # the files fit config.json: nothing is built otherwise
    arch = hf_load.served_tying(root, arch)
    _check_budget(root, mode, residency[2], weights_dtype, layout)
    return root, config_dict, arch, weights_dtype, divisible_by, mode


# the weights' dtypes by the number the ranks agree on
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _agreed_layout_build(path: Any, layout: Any, residency: tuple[str, int, ResidencyBudget | None], dtype: Any,
                         divisible: Any, core_attention: type | None, converter: str) -> list[torch.nn.Module]:
    """The build at `layout` once every rank of the default group passed its checks and holds the
    same layout, checkpoint shape, dtype and vocabulary padding (one all-gather: agreement.agree);
    else the same error on every rank before the group creation, a collective no rank may skip."""
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        check_layout(layout)  # raises: no group to agree over
    checked, error = agreement.local_error(lambda: _checked(path, residency, dtype, divisible, core_attention,
                                                              converter, layout))
    arch, weights_dtype = (checked[2], checked[3]) if checked is not None else (None, None)
    dtypes = ", ".join(f"{index} {str(kind).removeprefix('torch.')}" for index, kind in enumerate(_DTYPES))
    agreement.agree(torch.distributed.group.WORLD, "build_inference_model_from_hf", error=error,
                    where="the default process group", match={
                        **layout_values(layout),
                        f"dtype ({dtypes})": _DTYPES.index(weights_dtype) if weights_dtype in _DTYPES else None,
                        "make_vocab_size_divisible_by": checked[4] if checked is not None else None,
                        **{f"the checkpoint's {name}": getattr(arch, name, None)
                           for name in ("vocab_size", "hidden_size", "num_layers")}})
    assert checked is not None  # agreed: every rank's checks passed
    root, _, arch, weights_dtype, divisible_by, mode = checked
    return _build_at_layout(root, arch, layout, weights_dtype, divisible_by, core_attention,
                            (mode, residency[1], residency[2]))


def _build_at_layout(root: Any, arch: Any, layout: TeacherLayout, dtype: torch.dtype, divisible_by: int,
                     core_attention: type | None,
                     residency: tuple[str, int, ResidencyBudget | None]) -> list[torch.nn.Module]:
    """The teacher at `layout` on its own process groups (built here: a collective), each rank's
    shard (its tensor slice of its pipeline stage's layers) read from the files; the chunk carries
    its groups (`teacher_groups`) for scoring. `residency`: (mode, prefetch, budget) as at the
    student's layout: nothing of the residency reads parallel_state (the shard is built in host
    memory by the teacher's own provider, the loader writes the host copies at the teacher's own
    shard positions, and a unit is a layer of this rank's stage), so a swap / stream teacher holds
    its own shard on the host and moves it per forward."""
    groups = groups_of_agreed(layout)
    vocab = padded_vocab(arch.vocab_size, divisible_by, layout.tp)
    config = transformer_config(arch, dtype, config_sizes(layout))
    # this rank's pipeline stage: megatron-core splits the layers by the collection's pp group
    # (get_transformer_layer_offset), a block spec of layers that differ (dense first layers, Qwen3.5's
    # layer_types) lists this stage's (pp_rank), and each stage reads only the tensors of its own layers
    provider = model_provider(arch, config, vocab, core_attention, {"pg_collection": groups.pg_collection},
                              pp_rank=groups.pp_rank)
    stage: list[tuple[int | None, bool, bool]] = [(None, groups.pp_rank == 0, groups.pp_rank == groups.pp_size - 1)]
    error: Exception | None = None
    try:
        chunks = inference_build.build_checked(provider, *residency, stages=stage)
        gather_in_own_groups(chunks)  # multi-latent attention's down projections: in the teacher's group
        hf_load.load_hf_weights(chunks, root, arch, vocab, shard_ranks(groups))
    except Exception as exc:  # every rank learns of it: none is left to score alone
        error = exc
    agreement.agree(torch.distributed.group.WORLD, f"building the teacher at layout={layout!r}", error=error,
                    where="the default process group")  # every rank learns of a failure: none scores alone
    for chunk in chunks:
        setattr(chunk, "hf_vocab_size", arch.vocab_size)  # noqa: B010 - the real vocab, for the ops' vocab_size=
        setattr(chunk, "teacher_groups", groups)  # noqa: B010 - score_at_layout reads the teacher's groups here
    return chunks


def hf_vocab_size(path: str | os.PathLike[str]) -> int:
    """config.json's vocab_size of the checkpoint directory `path` (the real vocab, unpadded; a
    wrapper's text model's)."""
    return read_checkpoint_config(path).vocab_size
