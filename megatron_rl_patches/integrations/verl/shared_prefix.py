"""verl (0.9.x): its Megatron engine's passes pack a group's prompt once (MEGATRON_RL_PATCHES_SHARED_PREFIX=1).

verl's engine runs every pass of a worker through `MegatronEngine.forward_backward_batch(data,
loss_function, forward_only)`: the actor's training step (forward_only False), its log-prob pass and
the reference pass (forward_only True). That is the door: the setting is read there and, before the
pass's first collective, what verl's layout and the model can run is agreed over every rank
(`shared_prefix_doors`: a pass that cannot share packs each sample whole with one warning in verl's
words, a ValueError on every rank under MEGATRON_RL_PATCHES_STRICT=1). For the pass, each of the
engine's model chunks takes a forward pre-hook that builds the micro-batch's plan from what verl's
own packing hands the model: `gptmodel_forward_model_engine` and its fused twin
(`fused_forward_model_engine`) call `preprocess_thd_engine`, then the model with the packed ids and
their `PackedSeqParams`, keyword by keyword. The hook swaps that `packed_seq_params` for the plan's,
for the model call alone: verl keeps its own params for `postprocess_thd_engine`, and the prepared
model gives its output back in the rows verl packed (`shared_prefix.model_hooks`), so verl's
unpacking, its logits processors, the fused processor and the losses read what they read today.

The plan is built from the whole micro-batch as verl packs it: each sequence padded with 0 to a
multiple of TP (x 2 CP under context parallelism) inside its own `cu_seqlens` (`cu_seqlens_q` equals
`cu_seqlens_q_padded`), those padding rows taken as the sample's own tokens (computed as verl
computes them, never read). Where verl hands the model less than the whole (`whole_micro_batch`):
- context parallelism: each rank's zigzag share of the packed ids; the whole is rebuilt from every
  context-parallel rank's share (gathered: the ranks run each micro-batch's forward together), the
  plan built from it and each rank runs its share of the shorter stream;
- pipeline stages after the first: the samples unpacked (nested ids); the whole is packed from them
  as the first stage packs it, so every stage runs the same plan.

MTP training runs on the plan as megatron-core's does: verl's own MTP loss (its copy of the GPT module's
postprocess) rolls the labels it packed per depth on the micro-batch's packed rows (`planned_mtp_loss`,
in place of verl's bound `process_mtp_loss` while a planned pass runs).

What verl's layout cannot share packs whole, said once in verl's words: its padded `bshd` route
(`use_remove_padding=False`), dynamic context parallelism, vision-language models (packed after the
vision embedding) and router replay (routes recorded per packed row). verl's critic
(`MegatronEngineWithValueHead`) packs each sample whole.
"""
# lazy imports: optional dependency verl
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import torch

from megatron_rl_patches.integrations.megatron.shared_prefix_pass import PrefixPass, logged, prefix_pass
from megatron_rl_patches.integrations.shared_prefix_doors.decision import Reason
from megatron_rl_patches.integrations.shared_prefix_doors.frameworks import VERL
from megatron_rl_patches.integrations.shared_prefix_doors.table import Layout
from megatron_rl_patches.model.arguments import ArgumentsByName
from megatron_rl_patches.ops.context_rows import local_rows
from megatron_rl_patches.patching.shadow import shadowed
from megatron_rl_patches.settings import shared_prefix
from megatron_rl_patches.shared_prefix.context_parallel import WholeRotaryTable
from megatron_rl_patches.shared_prefix.mtp import planned_label_roll
from megatron_rl_patches.shared_prefix.plan import shared_prefix_plan_of

CUT = "zigzag"  # verl's static context parallelism (`_get_context_parallel_layout`: contiguous for DSv4 only)


def verl_layout(engine: Any) -> Layout:
    """What of verl's engine the shared-prefix table reads (verl's settings, the same on every rank)."""
    config = engine.engine_config
    return Layout(packed=bool(getattr(config, "use_remove_padding", True)),
                  dynamic_context=bool(getattr(config, "dynamic_context_parallel", False)),
                  vision=hasattr(getattr(engine.model_config, "hf_config", None), "vision_config"),
                  routing_replay=getattr(getattr(config, "router_replay", None), "mode", "disabled") != "disabled",
                  mtp_training=mtp_training(engine))


def mtp_training(engine: Any) -> bool:
    mtp = getattr(engine.model_config, "mtp", None)
    return bool(getattr(mtp, "enable", False) and getattr(mtp, "enable_train", False))


# verl's MTP loss before megatron-core's `process_mtp_loss` (0.18) rolls the labels with its own bound copy
# of megatron-core's roll, which a sharing plan's params do not reach
OLD_MTP_LOSS = Reason("MTP training on megatron-core before 0.18: verl's own MTP loss rolls the labels by the packed "
                      "sequences itself", "megatron-core 0.18 or later, or actor_rollout_ref.model.mtp.enable_train="
                      "False")


def verl_prefix_pass(engine: Any, what: str, training: bool) -> PrefixPass | None:
    """The pass's shared-prefix packing over the engine's chunks, or None: a pass that packs each sample
    whole (`prefix_pass`: decided alike on every rank before the pass's first collective). MTP training
    runs on the plan: verl's own copy of megatron-core's MTP loss rolls its labels on the micro-batch's
    packed rows (`planned_mtp_loss`)."""
    layout = verl_layout(engine)
    extra = (OLD_MTP_LOSS,) if layout.mtp_training and not _verl_has_process_mtp_loss() else ()
    return prefix_pass(what, engine.module, training=training, enabled=True, cut_layout=CUT, framework=VERL,
                       layout=layout, extra=extra)


def whole_micro_batch(ids: Any, params: Any, prefix: PrefixPass) -> tuple[Any, Any]:
    """(this rank's packed ids [1, T], the whole micro-batch [T_whole] or None) from verl's model call:
    its packed ids (this rank's share under context parallelism: every rank's gathered, the whole
    rebuilt) or, on a stage after the first, the samples unpacked (packed here as the first stage packs
    them: each at its `cu_seqlens_q` start, 0 after it)."""
    cu = params.cu_seqlens_q.cpu()
    if getattr(ids, "is_nested", False):
        samples = ids.unbind()
        whole = torch.zeros(int(cu[-1]), dtype=torch.int64, device=samples[0].device if samples else None)
        for sample, start in zip(samples, cu.tolist()):
            whole[start:start + sample.numel()] = sample.reshape(-1)
        if prefix.cut is None:
            return whole[None], None
        return whole[local_rows(CUT, prefix.cut.rank, prefix.cut.size, cu_seqlens=cu).to(whole.device)][None], whole
    if prefix.cut is None:
        return ids, None
    from megatron.core import parallel_state  # lazy: optional dependency megatron-core

    shares = [torch.empty_like(ids) for _ in range(prefix.cut.size)]
    torch.distributed.all_gather(shares, ids.contiguous(), group=parallel_state.get_context_parallel_group())
    whole = torch.zeros(int(cu[-1]), dtype=ids.dtype, device=ids.device)
    for rank, share in enumerate(shares):
        rows = local_rows(CUT, rank, prefix.cut.size, cu_seqlens=cu).to(ids.device)
        if rows.numel() != share.numel():
            return ids, None  # not verl's cut: the pass's check packs this micro-batch whole on every rank
        whole[rows] = share.reshape(-1)
    return ids, whole


def _verl_has_process_mtp_loss() -> bool:
    from verl.models.mcore import mtp_patch

    return bool(getattr(mtp_patch, "_HAS_PROCESS_MTP_LOSS", False))


def planned_mtp_loss(original: Any) -> Any:
    """verl's `mtp_patch._process_mtp_loss` (megatron-core's `process_mtp_loss`, bound by verl at import and
    called by verl's own GPT postprocess) for a planned pass: under a sharing plan the MTP labels and loss
    mask verl packed (rolled by verl) are rolled per depth on the micro-batch's packed rows, as
    megatron-core's own loss is (`planned_label_roll`), and verl's context-parallel group read from the
    plan's params (`_resolve_cp_group`: the plan's whole rotary table) is the model's. Without a plan: as it is."""
    planned = planned_label_roll(original)

    def process_mtp_loss(*args: Any, **kwargs: Any) -> Any:
        call = ArgumentsByName(original, args, kwargs)
        if shared_prefix_plan_of(call.get("packed_seq_params")) is None:
            return original(*args, **kwargs)
        if isinstance(call.get("cp_group"), WholeRotaryTable):
            from megatron.core import parallel_state  # lazy: optional dependency megatron-core

            call.set("cp_group", parallel_state.get_context_parallel_group())
        args, kwargs = call.done()
        return planned(*args, **kwargs)

    return process_mtp_loss


def mtp_loss_planned(engine: Any) -> Any:
    """For the pass: verl's MTP loss taking the plan (`planned_mtp_loss`, shadowing verl's module's name while
    the pass runs), where the engine trains MTP; nothing otherwise."""
    if not mtp_training(engine) or not _verl_has_process_mtp_loss():
        return contextlib.nullcontext()
    from verl.models.mcore import mtp_patch

    return shadowed(mtp_patch, _process_mtp_loss=planned_mtp_loss(mtp_patch._process_mtp_loss))


def carried_attributes(params: Any, planned: Any) -> Any:
    """`planned` (the plan's params) carrying what verl set on its own params beside the dataclass fields
    (`_verl_mtp_loss_normalization_factor`: its MTP loss scale under per-token loss)."""
    fields = {f.name for f in dataclasses.fields(params)} if dataclasses.is_dataclass(params) else set()
    for name, value in vars(params).items():
        if name not in fields:
            setattr(planned, name, value)
    return planned


def plan_hook(prefix: PrefixPass) -> Any:
    """A forward pre-hook (with kwargs) on a model chunk: verl's call with `thd` params runs the
    micro-batch's plan (`PrefixPass.params`: agreed over the tensor- and context-parallel ranks)."""

    def planned(module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        params, ids = kwargs.get("packed_seq_params"), kwargs.get("input_ids")
        if args or params is None or getattr(params, "qkv_format", None) != "thd" or ids is None:
            return None  # not verl's packed call: as it is
        if shared_prefix_plan_of(params) is not None:
            return None
        tokens, whole = whole_micro_batch(ids, params, prefix)
        samples = int(params.cu_seqlens_q.numel()) - 1
        planned = prefix.params(tokens, params, samples, whole)
        if planned is not params:
            planned = carried_attributes(params, planned)
        return args, dict(kwargs, packed_seq_params=planned)

    return planned


def forward_backward_batch_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper on `MegatronEngine.forward_backward_batch(data, loss_function, forward_only)`:
    with the setting on, the pass runs planned on every chunk (the figures logged when it ends)."""
    if not shared_prefix() or not _language_model_engine(instance):  # read at verl's pass, its door
        return wrapped(*args, **kwargs)
    forward_only = bool(args[2] if len(args) > 2 else kwargs.get("forward_only", False))
    what = "verl's forward-only pass" if forward_only else "verl's training step"
    prefix = verl_prefix_pass(instance, what, training=not forward_only)
    if prefix is None:
        return wrapped(*args, **kwargs)
    chunks = instance.module if isinstance(instance.module, (list, tuple)) else [instance.module]
    handles = [chunk.register_forward_pre_hook(plan_hook(prefix), with_kwargs=True, prepend=True) for chunk in chunks]
    try:
        with logged(prefix), mtp_loss_planned(instance):
            return wrapped(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()


def _language_model_engine(engine: Any) -> bool:
    """verl's engine with its LM head (the actor, the reference); not its critic's value head."""
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead, MegatronEngineWithValueHead

    return isinstance(engine, MegatronEngineWithLMHead) and not isinstance(engine, MegatronEngineWithValueHead)
