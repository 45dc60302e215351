"""A pass's micro-batches planned together, step by step, for a host whose pass door knows every
micro-batch of its steps before the first runs (slime's `forward_only` and `train_one_step`: the
rollout's samples and the schedule's indices into them).

Planned per micro-batch (`PrefixPass.params`), a prompt whose group the micro-batch budget cut is
computed again in each part. Here each step's micro-batches get one sharing plan
(`plan_shared_prefix_step`): a segment the step's micro-batches share is computed once, held, and in
training its backward runs once, in its last reader's (forward-only passes hold without gradients).
The door decides it, alike on every rank before the pass's first collective: a model that cannot hold
segments (`local_held_reasons`: pipeline stages, MTP, DSA, dropout in training, Sinkhorn), context
parallelism (holding is not wired through a host's context-parallel cut), or a step the plan
refuses (an id past the vocabulary, a vision-language sample, no schedule to read) on any rank
plans each micro-batch on its own as before, said once (a ValueError on every rank under
MEGATRON_RL_PATCHES_STRICT=1 where a step has two micro-batches or more). The plans are agreed over
the tensor-parallel group (its ranks run each micro-batch together) and planned over the
expert-parallel group (`group=`: its ranks' side passes and recomputes run together); each
micro-batch then takes its plan by its index in the pass (`PrefixPass.params(index=)`), checked
against the ids the host packed."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch

from megatron_rl_patches import settings
from megatron_rl_patches._log import warn_once
from megatron_rl_patches.ops.agreement import agree, agreed_max, gathered_objects, world
from megatron_rl_patches.shared_prefix.held_refusals import config_held_reasons, local_held_reasons
from megatron_rl_patches.shared_prefix.model_hooks import shared_prefix_params
from megatron_rl_patches.shared_prefix.step import plan_shared_prefix_step

STEP_WHOLE = ("shared prefix: {what}: each micro-batch plans its own samples (a prompt the micro-batch budget cuts "
              "is computed again in each part): {reason}")
CONTEXT_PARALLEL = ("context parallelism: segments held across micro-batches are not wired through the host's "
                    "context-parallel cut")


@dataclass(frozen=True)
class PackedMicroBatch:
    """One micro-batch as the host packs it: its ids [T] (padding included), `cu_seqlens` [n + 1]
    and how many of its sequences are samples (the rest padding)."""

    tokens: torch.Tensor
    cu_seqlens: torch.Tensor
    samples: int


def packed_micro_batch(samples: Sequence[Any], multiple: int) -> PackedMicroBatch:
    """`samples` (their ids) packed one after another and padded with id 0 to a multiple of
    `multiple`, the padding one more sequence (as slime's `get_batch` packs a micro-batch at CP = 1)."""
    ids = [torch.as_tensor(sample).reshape(-1).long().cpu() for sample in samples]
    bounds = [0]
    for one in ids:
        bounds.append(bounds[-1] + one.numel())
    pad = -bounds[-1] % multiple
    if pad:
        ids.append(torch.zeros(pad, dtype=torch.int64))
        bounds.append(bounds[-1] + pad)
    tokens = torch.cat(ids) if ids else torch.empty(0, dtype=torch.int64)
    return PackedMicroBatch(tokens, torch.tensor(bounds, dtype=torch.int64), len(samples))


def step_refusal(steps: Sequence[Sequence[PackedMicroBatch]], vocab: int | None) -> str | None:
    """Why this rank's steps cannot be planned together (None: they can): an id the plan refuses
    (packed whole per micro-batch, for the model's embedding to meet as without the plan)."""
    for step in steps:
        for batch in step:
            if batch.tokens.numel() and int(batch.tokens.min()) < 0:
                return f"a negative id ({int(batch.tokens.min())})"
            if vocab is not None and batch.tokens.numel() and int(batch.tokens.max()) >= vocab:
                return f"an id past the vocabulary ({int(batch.tokens.max())} >= {vocab})"
    return None


def hold_steps(prefix: Any, model: Any, *, training: bool, steps: Sequence[Sequence[PackedMicroBatch]] | None,
               first: int = 0, max_tokens: int | None = None, refusal: str | None = None,
               strict: bool = False) -> bool:
    """Plan `prefix`'s pass (a `PrefixPass`) step by step: `steps[s]` the micro-batches of step s, in
    the order the schedule runs them, the first the pass's micro-batch `first` (None: no schedule the
    host could read). Every rank calls it at the pass's door, after `prefix_pass`. A step whose
    micro-batches share no segment (on every rank of the expert-parallel group) is left to the plan per
    micro-batch, as today. True where the pass may hold segments (the steps' plans in `prefix.held`,
    their figures counted); False where every micro-batch plans on its own (the reason said once;
    raised under `strict`)."""
    from megatron.core import parallel_state  # lazy: optional dependency megatron-core

    reasons = local_held_reasons(model, training)
    if prefix.cut is not None:
        reasons.append(CONTEXT_PARALLEL)
    local = refusal or ("no micro-batch schedule to plan from" if steps is None else step_refusal(steps, prefix.vocab))
    if local is not None:
        reasons.append(local)
    named = sorted({str(r) for rs in gathered_objects(world(), reasons) for r in cast(list, rs or [])})
    if named:
        reason = "; ".join(named)
        if strict and steps is not None and any(len(step) > 1 for step in steps):
            raise ValueError(STEP_WHOLE.format(what=prefix.what, reason=reason) + "; or unset "
                             "MEGATRON_RL_PATCHES_STRICT")
        warn_once(STEP_WHOLE.format(what=prefix.what, reason=reason))
        return False
    assert steps is not None
    experts = parallel_state.get_expert_model_parallel_world_size()
    group = parallel_state.get_expert_model_parallel_group() if experts > 1 else None
    held: dict[int, tuple[PackedMicroBatch, Any]] = {}
    index = first
    fingerprint = [0, 0, 0]
    for step in steps:
        if not step:
            continue
        planned = plan_shared_prefix_step([(b.tokens, b.cu_seqlens) for b in step], samples=[b.samples for b in step],
                                          pad_to=prefix.pad_to, max_tokens=max_tokens, group=group,
                                          repeated_padding_once=prefix.repeated_padding_once)
        holds = int(planned.stats.held_tokens > 0)
        if not (agreed_max(group, holds) if group is not None else holds):  # nothing cut: planned per micro-batch
            index += len(step)
            continue
        for batch, plan in zip(step, planned.plans):
            held[index] = (batch, plan)
            index += 1
            physical, logical, checksum = plan.fingerprint()
            fingerprint = [fingerprint[0] + physical, fingerprint[1] + logical, (fingerprint[2] + checksum) % 2 ** 52]
            for name, value in plan.stats.as_dict().items():
                if name not in ("physical_tokens", "saved_tokens"):  # the step's, below: each segment once
                    prefix.figures[name] = prefix.figures.get(name, 0) + value
        stats = planned.stats
        for name, value in (("physical_tokens", stats.computed_tokens), ("held_tokens", stats.held_tokens),
                            ("saved_tokens", stats.logical_tokens - stats.computed_tokens),
                            ("recomputed_tokens", stats.recomputed_tokens if training else 0)):  # in backward
            prefix.figures[name] = prefix.figures.get(name, 0) + value
    agree(prefix.group, "a pass's shared-prefix step plans", match={
        "micro-batches": len(held), "physical rows": fingerprint[0], "logical rows": fingerprint[1],
        "checksum": fingerprint[2]}, where="the tensor-parallel group")
    prefix.held = held
    return True


def hold_scheduled(prefix: Any, model: Any, *, training: bool, rollout: Any, indices: Any, counts: Sequence[int],
                   first: int, budget: Any, pad_multiple: int) -> bool:
    """`hold_steps` for a host that hands a pass its rollout's per-sample fields (`rollout`: "tokens",
    and "multimodal_train_inputs" where samples carry images; slime's data iterator's) and its schedule
    (`indices[j]`: the samples of micro-batch j; `counts[s]`: step s's micro-batches, the first micro-batch
    `first`), packed as slime's `get_batch` packs them at CP = 1 (padded to `pad_multiple` times the
    tensor-parallel size); `budget`: the micro-batch budget (None: none)."""
    from megatron.core import parallel_state  # lazy: optional dependency megatron-core

    steps: list | None = None
    refusal = None
    if not isinstance(rollout, Mapping) or "tokens" not in rollout or not isinstance(indices, Sequence):
        refusal = "a data iterator without the rollout's samples and micro-batch indices"
    elif any(one is not None for one in rollout.get("multimodal_train_inputs") or []):
        refusal = "multimodal inputs (multimodal_train_inputs)"
    elif sum(counts) + first > len(indices):
        refusal = f"{sum(counts)} micro-batches from {first} in a schedule of {len(indices)}"
    else:
        multiple = parallel_state.get_tensor_model_parallel_world_size() * pad_multiple
        steps, at = [], first
        for count in counts:
            steps.append([packed_micro_batch([rollout["tokens"][i] for i in indices[j]], multiple)
                          for j in range(at, at + count)])
            at += count
    counted = isinstance(budget, int) and not isinstance(budget, bool) and budget > 0
    return hold_steps(prefix, model, training=training, steps=steps, first=first, refusal=refusal,
                      strict=settings.strict(), max_tokens=budget if counted else None)


def held_params(held: tuple[PackedMicroBatch, Any], tokens: Any, packed_seq_params: Any, index: int) -> Any:
    """The `packed_seq_params` of the pass's micro-batch `index` under its step's plan, once the ids
    and boundaries the host packed are those the plan was built from."""
    batch, plan = held
    cu = packed_seq_params.cu_seqlens_q
    if (not torch.equal(tokens.reshape(-1).cpu().long(), batch.tokens)
            or not torch.equal(cu.cpu().long(), batch.cu_seqlens)):
        raise RuntimeError(f"shared prefix: micro-batch {index} of the pass is not the one its step was planned "
                           "from at the pass's door (the host packed other ids or boundaries); please report this "
                           "with the host's version, and unset MEGATRON_RL_PATCHES_SHARED_PREFIX meanwhile")
    return shared_prefix_params(plan)


# a computed row's activations per layer kept for backward, in numbers (Korthikanti et al., 2022: 34 · h bytes
# in 16-bit numbers, attention's scores left out as flash attention keeps none)
ACTIVATIONS_PER_ROW = 17


def step_held_cost(args: Any) -> float | None:
    """What a row held across a training step's micro-batches costs against a computed row, for a model
    of Megatron's arguments `args` (`shared_prefix_micro_batches(held_cost=)`): per attention layer its
    keys and values and their gradients (4 · key/value groups · head width numbers) over a computed
    row's activations (`ACTIVATIONS_PER_ROW` · hidden size); None where the model's steps would not
    hold segments (`config_held_reasons`, context parallelism, MTP), read from the arguments alone (a
    scheduler that has no model: slime's rollout manager)."""
    experts = getattr(args, "num_experts", None) or getattr(args, "num_moe_experts", None)
    if (config_held_reasons(args, training=True) or int(getattr(args, "context_parallel_size", 1) or 1) > 1
            or getattr(args, "mtp_num_layers", None) or (experts and getattr(
                args, "moe_router_load_balancing_type", None) == "sinkhorn")):
        return None
    hidden = getattr(args, "hidden_size", None)
    heads = getattr(args, "num_attention_heads", None)
    if not isinstance(hidden, int) or not isinstance(heads, int) or hidden < 1 or heads < 1:
        return 4 / ACTIVATIONS_PER_ROW  # multi-head attention's: key/value groups · head width = hidden size
    width = getattr(args, "kv_channels", None) or hidden // heads
    groups = (getattr(args, "num_query_groups", None) if getattr(args, "group_query_attention", False) else None) \
        or heads
    return min(1.0, 4 * groups * width / (ACTIVATIONS_PER_ROW * hidden))
