"""The invariant mode of a framework step, resolved once from the student's model config where a
framework hands a patched caller the model (slime's `forward_only` / `train_one_step`, verl's engine
`forward_step`), then passed down explicitly: as an argument where our code calls our code, and
with the data where a framework's callback signature is fixed (slime's step plan on its data
iterators and batch, `fused_step`; the logits handed to slime's log-prob callbacks, `mode_logits`;
verl's micro-batch, `verl.topk`). No module-level or context variable holds it."""
from __future__ import annotations

from typing import Any

from megatron_rl_patches.model.chunks import as_chunks, unwrap
from megatron_rl_patches.ops.invariance import resolve_invariant


def model_config(model: Any) -> Any:
    """The config of a model or its first chunk (through DDP / Float16Module wrappers); None without one."""
    chunks = as_chunks(model)
    return getattr(unwrap(chunks[0]), "config", None) if chunks and chunks[0] is not None else None


def student_invariant(model: Any) -> bool:
    """The invariant mode of a step handed the student `model`: the setting, else its config's
    ``batch_invariant_mode`` (resolved once there, then passed down as an argument)."""
    config = model_config(model)
    return resolve_invariant(None, config)
