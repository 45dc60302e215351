"""verl (0.9.x): its Megatron engine's passes pack a group's prompt once (MEGATRON_RL_PATCHES_SHARED_PREFIX=1).

verl's engine runs every pass of a worker through `MegatronEngine.forward_backward_batch(data,
loss_function, forward_only)`: the actor's training step (forward_only False), its log-prob pass and
the reference pass (forward_only True). That is the door: the setting is read there, and, before the
pass's first collective, what the model and verl's layout can run is agreed over every rank (a
ValueError naming the setting and what to do, the same on every rank). For the pass, each of the
engine's model chunks takes a forward pre-hook that builds the micro-batch's plan from what verl's
own packing hands the model: `gptmodel_forward_model_engine` and its fused twin
(`fused_forward_model_engine`) call `preprocess_thd_engine`, then the model with the packed ids [1, T]
and their `PackedSeqParams`, keyword by keyword. The hook swaps that `packed_seq_params` for the
plan's, for the model call alone: verl keeps its own params for `postprocess_thd_engine`, and the
prepared model gives its output back in the rows verl packed (`shared_prefix.model_hooks`), so
verl's unpacking, its logits processors, the fused processor and the losses read what they read today.

verl pads each sequence to a multiple of the tensor-parallel size inside its own `cu_seqlens`
(`cu_seqlens_q` equals `cu_seqlens_q_padded`): a plan takes those padding rows as the sample's own
tokens, computed as verl computes them (never read by verl, exact for every row it reads).

What verl's layout cannot run planned, each refused by name: its padded `bshd` route
(`use_remove_padding=False`), context parallelism (verl cuts the ids per rank first), dynamic context
parallelism, pipeline parallelism (verl hands the later stages the ids unpacked), vision-language
models (packed after the vision embedding), MTP training (verl packs the MTP block's labels with its
own roll) and router replay (routes recorded per packed row). verl's critic
(`MegatronEngineWithValueHead`) packs each sample whole.
"""
# lazy imports: optional dependency verl
from __future__ import annotations

from typing import Any

from megatron_rl_patches import settings
from megatron_rl_patches.integrations.megatron.shared_prefix_pass import PrefixPass, logged, planned_pass
from megatron_rl_patches.ops.agreement import gathered_objects, world
from megatron_rl_patches.shared_prefix.plan import shared_prefix_plan_of
from megatron_rl_patches.shared_prefix.refusals import local_reasons

REMEDY = f"set {settings.SHARED_PREFIX}=0 for this job (each sample packed whole) or change the verl setting named"


def verl_layout_reasons(engine: Any) -> list[str]:
    """Why verl's layout on this rank cannot run a plan (each names verl's setting)."""
    from megatron.core import parallel_state  # lazy: optional dependency megatron-core

    config = engine.engine_config
    reasons = []
    if not getattr(config, "use_remove_padding", True):
        reasons.append("verl's padded layout (use_remove_padding=False) packs no sequences to share; set "
                       "use_remove_padding=True")
    if getattr(config, "dynamic_context_parallel", False):
        reasons.append("verl's dynamic context parallelism (dynamic_context_parallel=True) splits each sequence "
                       "over ranks; set it False")
    shares = parallel_state.get_context_parallel_world_size()
    if shares > 1:
        reasons.append(f"context parallelism (context_parallel_size={shares}): verl hands each rank its share of the "
                       "packed ids, and a plan is built from the whole micro-batch; set it 1")
    stages = parallel_state.get_pipeline_model_parallel_world_size()
    if stages > 1:
        reasons.append(f"pipeline parallelism (pipeline_model_parallel_size={stages}): verl hands the later stages "
                       "their ids unpacked; set it 1")
    model_config = engine.model_config
    if hasattr(getattr(model_config, "hf_config", None), "vision_config"):
        reasons.append("a vision-language model (hf_config.vision_config): verl packs its ids after the vision "
                       "embedding")
    mtp = getattr(model_config, "mtp", None)
    if getattr(mtp, "enable", False) and getattr(mtp, "enable_train", False):
        reasons.append("MTP training (mtp.enable_train=True): verl packs the MTP block's labels with its own roll; "
                       "set enable_train False")
    replay = getattr(getattr(config, "router_replay", None), "mode", "disabled")
    if replay != "disabled":
        reasons.append(f"router replay (router_replay.mode={replay!r}): verl records each packed row's experts; set "
                       "it 'disabled'")
    return reasons


def verl_prefix_pass(engine: Any, what: str, training: bool) -> PrefixPass:
    """The pass's shared-prefix packing over the engine's chunks, once every rank agreed that the
    model and verl's layout run a plan; else the same ValueError on every rank."""
    mine = verl_layout_reasons(engine) + local_reasons(engine.module, training)
    every = gathered_objects(world(), mine)
    named = sorted({str(reason) for reasons in every for reason in (reasons or [])})  # type: ignore[attr-defined]
    if named:
        raise ValueError(f"{settings.SHARED_PREFIX}=1: {what} cannot pack a group's prompt once: "
                         f"{'; '.join(named)}. {REMEDY[0].upper()}{REMEDY[1:]}.")
    return planned_pass(what, engine.module)


def plan_hook(prefix: PrefixPass) -> Any:
    """A forward pre-hook (with kwargs) on a model chunk: verl's call with packed ids and `thd`
    params runs the micro-batch's plan (`PrefixPass.params`: agreed over the tensor-parallel group)."""

    def planned(module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        params, ids = kwargs.get("packed_seq_params"), kwargs.get("input_ids")
        if args or params is None or getattr(params, "qkv_format", None) != "thd" or ids is None:
            return None  # not verl's packed call: as it is
        if shared_prefix_plan_of(params) is not None or getattr(ids, "is_nested", False):
            return None
        samples = int(params.cu_seqlens_q.numel()) - 1
        return args, dict(kwargs, packed_seq_params=prefix.params(ids, params, samples))

    return planned


def forward_backward_batch_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper on `MegatronEngine.forward_backward_batch(data, loss_function, forward_only)`:
    with the setting on, the pass runs planned on every chunk (the figures logged when it ends)."""
    if not settings.shared_prefix() or not _language_model_engine(instance):  # read at verl's pass, its door
        return wrapped(*args, **kwargs)
    forward_only = bool(args[2] if len(args) > 2 else kwargs.get("forward_only", False))
    what = "verl's forward-only pass" if forward_only else "verl's training step"
    prefix = verl_prefix_pass(instance, what, training=not forward_only)
    chunks = instance.module if isinstance(instance.module, (list, tuple)) else [instance.module]
    handles = [chunk.register_forward_pre_hook(plan_hook(prefix), with_kwargs=True, prepend=True) for chunk in chunks]
    try:
        with logged(prefix):
            return wrapped(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()


def _language_model_engine(engine: Any) -> bool:
    """verl's engine with its LM head (the actor, the reference); not its critic's value head."""
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead, MegatronEngineWithValueHead

    return isinstance(engine, MegatronEngineWithLMHead) and not isinstance(engine, MegatronEngineWithValueHead)
