"""What every teacher-layout scoring entry point does first (CONTEXT.md section 17): find the
chunks' model and groups, check this rank's arguments and input, and agree them over the teacher
replica in one all-gather (gather.agree) before any other collective, so a failure on any rank is
the same error on every rank and an argument that shapes the replica's work (temperature, the
scored vocabulary, the invariant mode, k, ...) is never combined from two values."""
from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from megatron_rl_patches.inference.teacher_layout.gather import GroupBatch, agree, check_inputs
from megatron_rl_patches.inference.teacher_layout.groups import TeacherGroups, built_groups
from megatron_rl_patches.inference.teacher_layout.layout import TeacherLayout
from megatron_rl_patches.model.chunks import unwrap
from megatron_rl_patches.ops.agreement import local_error
from megatron_rl_patches.ops.invariance import resolve_invariant


@dataclass(frozen=True)
class AgreedCall:
    """One agreed call: the model and groups of the chunks, the replica's shapes, the scored
    vocabulary (vocab_size, or the checkpoint's), the temperature and the invariant mode."""

    model: torch.nn.Module
    groups: TeacherGroups
    batch: GroupBatch
    vocab: int
    temperature: float
    invariant: bool


def _model_and_groups(chunks: Any) -> tuple[torch.nn.Module, TeacherGroups]:
    if isinstance(chunks, torch.nn.Module):
        chunks = [chunks]
    if not isinstance(chunks, (list, tuple)) or len(chunks) != 1 or not isinstance(chunks[0], torch.nn.Module):
        raise TypeError("chunks must be the one-chunk list that build_inference_model_from_hf(layout=...) returns "
                        f"(or its chunk), got {type(chunks).__name__}")
    groups = getattr(chunks[0], "teacher_groups", None)
    if not isinstance(groups, TeacherGroups):
        raise ValueError("chunks were not built at a teacher layout: build them with "
                         "build_inference_model_from_hf(path, layout=TeacherLayout(tp=N))")
    return chunks[0], groups


def _temperature(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"temperature must be a positive number (the same on every rank), got {type(value).__name__}")
    if not math.isfinite(float(value)) or float(value) <= 0:
        raise ValueError(f"temperature must be a positive finite number (it divides the logits), got {value!r}")
    return float(value)


def _vocab(value: Any, model: torch.nn.Module) -> tuple[int, int]:
    """(the scored vocabulary: `value` or the checkpoint's, the tokens' bound: the checkpoint's)."""
    padded = int(unwrap(model).vocab_size)
    real = int(getattr(model, "hf_vocab_size", None) or padded)
    if value is None:
        return real, real
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 1 <= int(value) <= padded:
        raise ValueError(f"vocab_size must be None (the checkpoint's {real}) or an int in [1, {padded}] (the "
                         f"teacher's padded vocabulary), got {value!r}")
    return int(value), real


def enter(what: str, chunks: Any, layout: Any, tokens: Any, others: dict[str, Any], *, temperature: Any = 1.0,
          vocab_size: Any = None, checks: Callable[[torch.nn.Module, int], None] | None = None,
          match: dict[str, Any] | None = None, invariant: Any = None) -> AgreedCall:
    """Checks and agreement of one call of `what` (tokens None: no input, e.g. the output weight).
    `checks(model, vocab)`: the call's own (raising); `match`: its own values that must match;
    `invariant`: the vocabulary ops' mode (None: the setting), agreed like the rest.
    A rank whose chunks hold no teacher groups joins the replica of the only layout this process
    built (or `layout`'s), so every rank is told; with none it is refused alone (it has no group)."""
    found, error = local_error(lambda: _model_and_groups(chunks))
    if found is None:
        groups = built_groups(layout if isinstance(layout, TeacherLayout) else None)
        if groups is None:
            assert error is not None  # what _model_and_groups raised
            raise error
    else:
        model, groups = found

    def local() -> tuple[float, int, bool]:
        if error is not None:
            raise error
        if layout is not None and layout != groups.layout:
            raise ValueError(f"layout={layout!r} differs from the layout the chunks were built at ({groups.layout!r})")
        tau = _temperature(temperature)
        vocab, token_vocab = _vocab(vocab_size, model)
        mode = resolve_invariant(invariant)
        if checks is not None:
            checks(model, vocab)
        if tokens is not None:
            check_inputs(tokens, others, token_vocab, vocab)
        return tau, vocab, mode

    agreed, error = local_error(local)
    tau, vocab, chosen = agreed if agreed is not None else (None, None, None)
    batch = agree(groups, what, tokens, others, error,
                  {"temperature": tau, "vocab_size": vocab, "invariant mode (MEGATRON_RL_PATCHES_INVARIANT)": chosen,
                   **(match or {})})
    assert tau is not None and vocab is not None and chosen is not None  # agreed: every rank's checks passed
    return AgreedCall(model, groups, batch, vocab, tau, chosen)
