"""What a fused output-processor route asks of one megatron-core model chunk, whichever framework
hands it over (the chunk itself, its unwrapping and whether it is the last pipeline stage:
`model.chunks`): whether its `forward` / `build_schedule_plan` takes GPTModel's
`output_processor` keyword (`accepts_processor`, `schedule_plan_unservable`), whether its MTP heads
would still build [T, V] logits (`mtp_heads_build_logits`) and a micro-batch's qkv layout
(`batch_layout`). slime's fused route (`integrations.slime.fused`) is its caller today."""
from __future__ import annotations

import inspect
import sys
from typing import Any

from megatron_rl_patches.model.chunks import is_last_stage, unwrap
from megatron_rl_patches.processors.mtp_loss import fused_mtp_loss_in_effect

SCHEDULE_PLAN_FALLBACK = ("the combined-1F1B schedule plan (this megatron-core's model.build_schedule_plan has no "
                          "output_processor keyword; megatron-core >= 0.18 has it)")


def accepts_processor(model: Any, method: str = "forward") -> bool:
    """Whether the chunk's `method` takes `output_processor` and `output_processor_context`."""
    inner = unwrap(model)
    try:
        parameters = inspect.signature(getattr(inner, method)).parameters
    except (AttributeError, TypeError, ValueError):
        return False
    return "output_processor" in parameters and "output_processor_context" in parameters


def schedule_plan_unservable(model: Any) -> str | None:
    """Why the combined-1F1B plan of this chunk goes to the framework's logits path, or None: the
    last stage's `build_schedule_plan` must take `output_processor` (megatron-core >= 0.18)."""
    if not is_last_stage(model) or accepts_processor(model, "build_schedule_plan"):
        return None
    return SCHEDULE_PLAN_FALLBACK


def mtp_heads_build_logits(model: Any) -> bool:
    """Whether this chunk's MTP heads would project [T, V] logits beside the fused main head: on
    megatron-core >= 0.18 (`process_mtp_loss` in the model's module) unless patch
    `mtp_output_processor` is in effect; before 0.18 the GPT backport serves them."""
    inner = unwrap(model)
    if not getattr(getattr(inner, "config", None), "mtp_num_layers", None):
        return False
    module = sys.modules.get(type(inner).__module__)
    namespace = vars(module) if module is not None else {}
    return "process_mtp_loss" in namespace and not fused_mtp_loss_in_effect(namespace)


def batch_layout(packed_seq_params: Any) -> str:
    """The micro-batch's qkv layout: its `packed_seq_params.qkv_format`, "bshd" without packing
    ("thd" for a shared-prefix plan: the rows the model hands back are the packed micro-batch's)."""
    if getattr(packed_seq_params, "shared_prefix", None) is not None:
        return "thd"
    if packed_seq_params is None:
        return "bshd"
    return str(getattr(packed_seq_params, "qkv_format", "thd"))
