"""Stand-in for slime's checkpoint module: load_checkpoint reads args.load (slime reads
get_args().load; here the module-level ARGS a test sets) and would use megatron-bridge for a
HuggingFace directory. Every call is recorded in CALLS."""
from __future__ import annotations

from typing import Any

CALLS: list[tuple[Any, ...]] = []
ARGS: Any = None


def load_checkpoint(ddp_model, optimizer, opt_param_scheduler, checkpointing_context, skip_load_to_model_and_opt):
    CALLS.append((ARGS.load, ddp_model, optimizer, opt_param_scheduler))
    return 0, 0
