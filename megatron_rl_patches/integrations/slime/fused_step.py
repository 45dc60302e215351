"""One slime step on the fused route, shared by `fused` (which runs it) and `opd` (which asks it for
top-k buckets): what the fused model call needs (`FusedStep`, `TopkRequest`), carried by the data
iterators through slime's step (`integrations.megatron.step_iterators`) to the batch the loss reads
it from (`FUSED_STEP`, `fused_step_in`), the rollout-data keys top-k OPD adds with the request its
training step makes (`step_request`), and slime's settings as its doors read them (`SlimeSettings`:
top-k OPD's and the shared-prefix switch, read once per slime `args` and held by it;
`slime_settings`, `slime_prefix_pass`).

slime's callbacks have fixed signatures (`get_batch`, the schedule's `forward_step_func`, the loss),
so the step travels with the data slime hands them: the iterators and the batch (`FUSED_STEP`)."""
from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from megatron_rl_patches.integrations.megatron.opd.opd_settings import LOSS_PATHS, OpdSettings, opd_settings
from megatron_rl_patches.integrations.megatron.opd.opd_teachers import training_request
from megatron_rl_patches.integrations.megatron.opd.topk_request import TopkRequest
from megatron_rl_patches.integrations.megatron.shared_prefix_pass import PrefixPass, prefix_pass
from megatron_rl_patches.integrations.megatron.shared_prefix_step_pass import hold_scheduled
from megatron_rl_patches.integrations.shared_prefix_doors.frameworks import SLIME
from megatron_rl_patches.integrations.shared_prefix_doors.table import Layout
from megatron_rl_patches.integrations.slime.model_kinds import register_model_kinds
from megatron_rl_patches.integrations.slime.routing_replay_records import next_records, replay_reasons, slime_replays
from megatron_rl_patches.settings import shared_prefix
from megatron_rl_patches.shared_prefix.moe_statistics import register_replay_check


@dataclass
class FusedStep:
    """What the fused model call of one slime step needs: slime's args, whether entropy is wanted
    (and its gradient), top-k buckets if asked, and the micro-batch `get_batch` returned last.
    `fused=False`: a step on slime's own logits path that still fetches the request's batch keys.
    `invariant`: the student's invariant mode, resolved once where the step is handed the model
    (None: the ops resolve their own); `settings`: top-k OPD's, read at slime's door (None: off);
    `prefix`: the pass's shared-prefix packing (None: each sample whole)."""

    args: Any
    with_entropy: bool
    entropy_requires_grad: bool
    topk: TopkRequest | None = None
    batch: dict | None = field(default=None, repr=False)
    fused: bool = True
    invariant: bool | None = None
    settings: OpdSettings | None = field(default=None, repr=False)
    prefix: PrefixPass | None = field(default=None, repr=False)


# the batch key under which a fused step's `get_batch` hands the loss its `FusedStep`
FUSED_STEP = "megatron_rl_patches_fused_step"
# the attribute of slime's `args` holding its settings as read there (`held_settings`)
HELD = "_megatron_rl_patches_settings"


def fused_step_in(batch: Any) -> FusedStep | None:
    """The step a fused step's `get_batch` put in its micro-batch (None: a batch of slime's own)."""
    return batch.get(FUSED_STEP) if isinstance(batch, dict) else None


def slime_settings(args: Any) -> OpdSettings | None:
    """Top-k OPD's settings (None: off) as slime's doors read them (the actor's `init` and
    `train_actor`, `train_one_step`, the rollout manager's split and the rollout's sample hooks):
    parsed once per slime `args` (the namespace every patched slime call is handed, in the training
    actors and the rollout manager alike) and held by it, then passed down as arguments."""
    return held_settings(args).opd


def slime_prefix_pass(args: Any, model: Any, what: str, training: bool, iterators: Any = None,
                      counts: Sequence[int] | None = None, first: int | None = None) -> PrefixPass | None:
    """The shared-prefix packing of slime's pass `what` over `model` (None: each sample whole), its
    switch MEGATRON_RL_PATCHES_SHARED_PREFIX read once per slime `args` as `slime_settings` is. slime's
    `get_batch` keeps every sample whole beside each context-parallel rank's cut (zigzag, or a contiguous
    slice with --allgather-cp), so its passes plan at context parallelism too (`whole_micro_batch`). slime's
    routing replay (--use-routing-replay, --use-rollout-routing-replay) replays routes per packed token: each
    micro-batch's plan shares only the rows whose records agree (`routing_replay_records`); at context or
    pipeline parallelism its passes pack whole, said once in slime's words. With slime's data `iterators`,
    the pass's micro-batches per step (`counts`) and the first's index in slime's schedule (`first`; None:
    the iterators' offset) each step's micro-batches are planned together where the budget cut a group
    (not under routing replay: its records are each micro-batch's)."""
    cut = "contiguous" if getattr(args, "allgather_cp", False) else "zigzag"
    replaying = bool(getattr(args, "use_routing_replay", False) or getattr(args, "use_rollout_routing_replay", False))
    layout = Layout(context_layout=cut, routing_replay=replaying)
    register_model_kinds()  # slime's own layers, before the plan reads the model
    register_replay_check(slime_replays)  # slime's replay routes the plan's packed rows
    prefix = prefix_pass(what, model, training=training, enabled=held_settings(args).shared_prefix, cut_layout=cut,
                         framework=SLIME, layout=layout, extra=replay_reasons(args))
    if prefix is not None and replaying:
        prefix.records = next_records
        return prefix
    if prefix is not None and counts is not None:
        iterator = iterators[0] if isinstance(iterators, Sequence) and iterators else iterators
        budget = getattr(args, "max_tokens_per_gpu", None) if getattr(args, "use_dynamic_batch_size", False) else None
        hold_scheduled(prefix, model, training=training, rollout=getattr(iterator, "rollout_data", None),
                       indices=getattr(iterator, "micro_batch_indices", None), counts=counts,
                       first=int(getattr(iterator, "offset", 0)) if first is None else first, budget=budget,
                       pad_multiple=int(getattr(args, "data_pad_size_multiplier", 128)))
    return prefix


@dataclass(frozen=True)
class SlimeSettings:
    """slime's settings as its doors read them: top-k OPD's (None: off) and whether the passes pack
    a group's prompt once (MEGATRON_RL_PATCHES_SHARED_PREFIX)."""

    opd: OpdSettings | None
    shared_prefix: bool


def held_settings(args: Any) -> SlimeSettings:
    """slime's settings as its `args` hold them: read at the first door, then handed down."""
    held = getattr(args, HELD, None)
    if not isinstance(held, SlimeSettings):
        held = SlimeSettings(opd_settings(), shared_prefix())
        with contextlib.suppress(AttributeError, TypeError):  # no namespace to hold them: read for this call
            setattr(args, HELD, held)
    return held


def step_request(args: Any, settings: OpdSettings | None) -> TopkRequest | None:
    """The top-k request of slime's training step: the student scores the rollout's ids (with
    their padding mask for a union) when top-k OPD is on (`settings`: the step's, None when off)
    and slime's loss is top-k OPD's."""
    if settings is None or getattr(args, "custom_loss_function_path", None) not in LOSS_PATHS:
        return None
    if getattr(args, "loss_type", None) != "custom_loss":
        return None
    return training_request(settings)  # the student scores the rollout's ids, or the whole vocabulary
