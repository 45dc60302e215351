"""The language models (megatron-core's GPTModel, HybridModel, MambaModel and their kin, read from what
they hold: `model.kinds.is_language_model`) and the wrappers around them (Float16Module, DDP, a
framework's own: the `.module` chain, `model.chunks`). A language model runs its own forward under a
plan; its seams are the ids it is called with, which become the plan's physical ids and each token's
own position (`physical_inputs`, a forward pre-hook), and its decoder's output, read back at each
logical row on the last pipeline stage (`logical_rows`, a forward hook of the decoder).

At its first planned call (and again only when the call's config or its training flag is new) the
language model refuses by name what `check_shared_prefix` refuses of its config (`FirstCall`, held
by the model): a loop that calls the model without that check never runs a plan silently wrong.
Every rank holds the same config, so every rank raises the same words, before the pass's first
collective."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from megatron_rl_patches.model.arguments import ArgumentsByName
from megatron_rl_patches.model.chunks import iter_wrapped
from megatron_rl_patches.model.kinds import is_language_model
from megatron_rl_patches.shared_prefix.context_parallel import gathered_stream, module_share, taken
from megatron_rl_patches.shared_prefix.kinds.kind import ByCode, Continuation
from megatron_rl_patches.shared_prefix.plan import shared_prefix_plan_of

FIRST_CALL = "_megatron_rl_patches_shared_prefix_first_call"  # the model's `FirstCall`, set by prepare_shared_prefix


class FirstCall:
    """What a prepared language model refuses of its config at a planned call, read once per config
    and training flag (`reasons(model, training)`: the refusals' words for that config, joined)."""

    def __init__(self, reasons: Callable[[Any, bool], str | None]) -> None:
        self.reasons = reasons
        self.read: dict[tuple[int, bool], str | None] = {}

    def check(self, model: Any) -> None:
        training = bool(model.training and torch.is_grad_enabled())
        key = (id(model.config), training)
        if key not in self.read:
            self.read = {key: self.reasons(model, training)}  # one config at a time: the one the model holds
        reason = self.read[key]
        if reason is not None:
            raise ValueError(f"shared prefix: {reason} (this model's config, which check_shared_prefix refuses before "
                             "the pass): do not pack its micro-batches by shared prefix")


def physical_inputs(module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """Forward pre-hook of the language model: the logical ids -> the plan's physical ids and
    positions (a stage without the embedding takes the previous stage's physical rows as they come)."""
    call = ArgumentsByName.of_forward(module, args, kwargs)
    params = call.get("packed_seq_params")
    plan = shared_prefix_plan_of(params)
    if plan is None:
        return None
    first_call: FirstCall | None = getattr(module, FIRST_CALL, None)
    if first_call is not None:
        first_call.check(module)
    if module.pre_process and call.get("decoder_input") is None:
        ids = call.get("input_ids")
        held = module_share(module, plan, params)
        share = None if held is None else held[0]
        length = plan.logical_length if share is None else int(share.logical.numel())
        if not isinstance(ids, torch.Tensor) or tuple(ids.shape) != (1, length):
            shape = tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
            mine = "" if share is None else f" (this context-parallel rank's {params.cp_layout} share of them)"
            raise ValueError(f"shared prefix: input_ids must be the packed ids the plan was built from{mine}, [1, "
                             f"{length}], got {shape}")
        logical = (plan.on(ids.device, "logical_tokens") if share is None
                   else taken(plan, share, "logical_tokens", "logical", ids.device))
        if not torch.equal(ids[0].to(torch.int64), logical):
            raise ValueError("shared prefix: input_ids differ from the ids the plan was built from (build the plan "
                             "from this micro-batch's tokens" + ("" if share is None else ", whole on every context-"
                             f"parallel rank, and pass cp_layout={params.cp_layout!r} only for ids cut that way") + ")")
        vocab = int(module.vocab_size)
        if plan.physical_length and int(plan.tokens.max()) >= vocab:
            raise ValueError(f"shared prefix: token id {int(plan.tokens.max())} is past the model's vocabulary "
                             f"({vocab} ids)")
        if plan.physical_length and int(plan.tokens.min()) < 0:
            raise ValueError(f"shared prefix: token id {int(plan.tokens.min())} is negative: the model's ids are 0 "
                             f"to {vocab - 1}")
        if share is None:
            call.set("input_ids", plan.on(ids.device, "tokens")[None])
            call.set("position_ids", plan.on(ids.device, "positions")[None])
        else:
            call.set("input_ids", taken(plan, share, "tokens", "physical", ids.device)[None])
            call.set("position_ids", taken(plan, share, "positions", "physical", ids.device)[None])
    if call.get("padding_mask") is not None:
        raise ValueError("shared prefix: padding_mask is not taken with a shared-prefix plan (the plan's padding "
                         "rows are its own); pass padding_mask=None")
    return call.done()


def logical_rows(module: Any, args: tuple, kwargs: dict, output: Any) -> Any:
    """Forward hook of the decoder: on the last pipeline stage, its physical rows read at each
    logical row (under sequence parallelism: gathered, read, scattered back)."""
    params = kwargs.get("packed_seq_params")
    plan = shared_prefix_plan_of(params)
    if plan is None or not getattr(module, "post_process", True):
        return None
    if not isinstance(output, torch.Tensor):
        raise ValueError(f"shared prefix: the decoder returned {type(output).__name__}, not its hidden states")
    from megatron.core import parallel_state, tensor_parallel  # lazy: optional dependency megatron-core

    sequence_parallel = bool(getattr(module.config, "sequence_parallel", False))
    tp = parallel_state.get_tensor_model_parallel_world_size() if sequence_parallel else 1
    hidden = output
    held = module_share(module, plan, params)
    logical = plan.logical_length if held is None else int(held[0].logical.numel())
    if tp > 1:
        if logical % tp:
            raise ValueError(f"shared prefix: under sequence parallelism the packed micro-batch ({logical} tokens"
                             f"{'' if held is None else ' on this context-parallel rank'}) must split evenly over "
                             f"the {tp} tensor-parallel ranks")
        # every rank reads the whole stream: the gradient each gets back is the whole one, so keep a split
        hidden = tensor_parallel.gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
    if held is None:
        rows = hidden.index_select(0, plan.on(hidden.device, "logical_rows"))
    else:  # every rank's physical rows, read at this rank's logical rows
        share, group = held
        whole = gathered_stream(hidden, plan, share, group)
        rows = whole.index_select(0, taken(plan, share, "logical_rows", "logical", whole.device))
    if tp > 1:
        rows = tensor_parallel.scatter_to_sequence_parallel_region(rows)
    return rows


class LanguageModels(ByCode):
    def recognizes(self, module: Any) -> bool:
        return any(is_language_model(link) for link in iter_wrapped(module))

    def prepare(self, module: Any) -> bool:
        if not is_language_model(module):
            return False  # a wrapper: the language model inside it is prepared itself
        module.register_forward_pre_hook(physical_inputs, with_kwargs=True)
        module.decoder.register_forward_hook(logical_rows, with_kwargs=True)
        return True


OUTPUT = "output"  # what a shared segment hands the language model's continuation: its rows' decoder output
LANGUAGE_MODELS = LanguageModels("language model", continuation=Continuation(roles=(OUTPUT,)))
