"""Multi-token prediction (megatron-core's `MultiTokenPredictionBlock`: MiMo's, GLM-4.7-Flash's,
DeepSeek-V3's) under a shared-prefix plan.

The MTP block sees at row t the decoder's state of token t and the embedding of token t + 1 (its
input ids rolled by one within each sequence), so at a prefix's last row each member's next token
differs: the prefix shares one token less there, and every later depth one more. The block is one
layer (or D) against the decoder's N, so it runs on the *logical* rows, as the packed path runs
it: the decoder's states read at each logical row (what the plan's decoder hook already hands on),
the ids and positions as packed, and megatron-core's ordinary `thd` params of the micro-batch's
sequences (each sample from its position 0, then the padding as one sequence). Its loss's labels
and mask are rolled by the same params: megatron-core rolls them in `GPTModel._postprocess` with
the call's `packed_seq_params`, so the model module's `roll_tensor` reads a plan's params as the
logical ones (any other call as before). Exact: the MTP block computes what the packed path
computes, its gradient into the decoder's states summed back into each shared row; the decoder's
saving is kept, the MTP layer's tokens are the packed path's."""
# lazy imports: optional dependency megatron-core
from __future__ import annotations

import functools
from typing import Any

import torch

from megatron_rl_patches.model.arguments import ArgumentsByName
from megatron_rl_patches.shared_prefix.plan import SharedPrefixPlan, shared_prefix_plan_of

ROLL_MARK = "_megatron_rl_patches_shared_prefix_roll"


def is_mtp_block(module: Any) -> bool:
    """megatron-core's MTP block (its layers, each with an embedding roll)."""
    return type(module).__name__ == "MultiTokenPredictionBlock"


def logical_positions(plan: SharedPrefixPlan) -> torch.Tensor:
    """[T]: each logical row's position in its own sample; the padding counted from 0 as one sequence."""
    def build() -> torch.Tensor:
        positions = plan.positions.index_select(0, plan.logical_rows)
        samples_end = plan.stats.logical_tokens
        positions[samples_end:] = torch.arange(plan.logical_length - samples_end)
        return positions

    return plan.cached(("mtp-positions",), build)


def logical_params(plan: SharedPrefixPlan) -> Any:
    """megatron-core's `thd` params of the micro-batch as packed: a sample starts where its position
    is 0; the rows past the samples are one padding sequence."""
    def build() -> Any:
        from megatron.core.packed_seq_params import PackedSeqParams

        positions = logical_positions(plan)
        samples_end = plan.stats.logical_tokens
        starts = torch.nonzero(positions[:samples_end] == 0).flatten().tolist()
        bounds = [*starts, samples_end] + ([plan.logical_length] if plan.logical_length > samples_end else [])
        cu = torch.tensor(bounds, dtype=torch.int32)
        longest = int(cu.diff().max()) if cu.numel() > 1 else 1
        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
                               max_seqlen_kv=longest)

    return plan.cached(("mtp-params",), build)


def logical_mtp_inputs(module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """Forward pre-hook of the MTP block: the packed ids, positions and `thd` params of the plan's
    micro-batch (the decoder's states arrive at the logical rows already)."""
    call = ArgumentsByName.of_forward(module, args, kwargs)
    plan = shared_prefix_plan_of(call.get("packed_seq_params"))
    if plan is None:
        return None
    hidden = call.get("hidden_states")
    device = hidden.device if isinstance(hidden, torch.Tensor) else torch.device("cpu")
    call.set("input_ids", plan.on(device, "logical_tokens")[None])
    call.set("position_ids", plan.cached(("mtp-positions", str(device)),
                                         lambda: logical_positions(plan).to(device))[None])
    call.set("packed_seq_params", logical_params(plan))
    return call.done()


def install_label_roll() -> None:
    """megatron-core's GPT module rolls the MTP labels and loss mask by the call's params (0.16: its
    `roll_tensor` in `_postprocess`; 0.19: `process_mtp_loss`, which also derives labels from the
    call's ids where none are given): a plan's params are read as the micro-batch's logical ones, its
    ids as the packed ids (once per process; other calls unchanged)."""
    from megatron.core.models.gpt import gpt_model

    name = "process_mtp_loss" if hasattr(gpt_model, "process_mtp_loss") else "roll_tensor"
    original = getattr(gpt_model, name, None)
    if original is None or getattr(original, ROLL_MARK, False):
        return

    @functools.wraps(original)
    def logical(*args: Any, **kwargs: Any) -> Any:
        call = ArgumentsByName(original, args, kwargs)
        plan = shared_prefix_plan_of(call.get("packed_seq_params"))
        if plan is not None:
            call.set("packed_seq_params", logical_params(plan))
            ids = call.get("input_ids")
            if isinstance(ids, torch.Tensor):
                call.set("input_ids", plan.on(ids.device, "logical_tokens")[None])
            args, kwargs = call.done()
        return original(*args, **kwargs)

    setattr(logical, ROLL_MARK, True)
    setattr(gpt_model, name, logical)


def prepare_mtp_block(block: Any) -> None:
    block.register_forward_pre_hook(logical_mtp_inputs, with_kwargs=True)
    install_label_roll()
