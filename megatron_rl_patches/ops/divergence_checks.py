"""The input checks of the full-vocabulary divergence (`lm_head_divergence`): its options and the
teachers' hidden states and output weights. The shared primitives are in :mod:`._checks`.
"""
from __future__ import annotations

import torch

from megatron_rl_patches.ops._checks import DeviceChecks, check_float_tensor
from megatron_rl_patches.ops._divergences import check_divergence


class VocabularyMismatchError(ValueError):
    """A teacher's output weight does not share the student's vocabulary or TP sharding."""


def check_divergence_options(divergence: object, beta: object, alpha: object) -> tuple[str, float, float]:
    """(name, β, α) checked by the divergence family's one check (named errors, see _divergences)."""
    return check_divergence(divergence, beta, alpha)


def _as_models(value: object, name: str) -> tuple[list[object], bool]:
    if isinstance(value, torch.Tensor):
        return [value], True
    if isinstance(value, (list, tuple)):
        return list(value), False
    raise TypeError(f"{name} must be a tensor (one teacher) or a list/tuple of tensors (several), "
                    f"got {type(value).__name__}")


def check_teacher_models(teacher_hidden: object, teacher_weight: object, hidden: torch.Tensor, weight: torch.Tensor,
                         checks: DeviceChecks) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """[(teacher_hidden_j, teacher_weight_j)]: each [T, H_t] / [V_local, H_t] with the student's rows,
    vocabulary shard and device; VocabularyMismatchError for another V_local; finite hidden
    states checked through `checks`."""
    hs, single_h = _as_models(teacher_hidden, "teacher_hidden")
    ws, single_w = _as_models(teacher_weight, "teacher_weight")
    if single_h != single_w or len(hs) != len(ws) or not hs:
        raise ValueError(f"teacher_hidden and teacher_weight must both be one tensor or sequences of the same "
                         f"length >= 1 (one pair per teacher), got {len(hs)} hidden and {len(ws)} weights")
    models = []
    for j, (h, w) in enumerate(zip(hs, ws)):
        hn, wn = ("teacher_hidden", "teacher_weight") if single_h else (f"teacher_hidden[{j}]", f"teacher_weight[{j}]")
        h = check_float_tensor(h, hn, "[T, H_t] (the teacher's final hidden states, rows as hidden's)")
        w = check_float_tensor(w, wn, "[V_local, H_t] (the teacher's vocab shard of its output weight)")
        if h.dim() != 2 or h.shape[0] != hidden.shape[0]:
            raise ValueError(f"{hn} must be [T, H_t] with T = {hidden.shape[0]} (hidden's rows, the same tokens), "
                             f"got shape {tuple(h.shape)}")
        if w.dim() != 2 or w.shape[1] != h.shape[1]:
            raise ValueError(f"{wn} must be [V_local, H_t] with H_t = {h.shape[1]} ({hn}'s last dim), "
                             f"got shape {tuple(w.shape)}")
        if w.shape[0] != weight.shape[0]:
            raise VocabularyMismatchError(
                f"{wn} holds {w.shape[0]} vocabulary rows but the student's weight {weight.shape[0]}: every model "
                f"must share the vocabulary and its tensor-parallel sharding (same padded size, same tp); pad or "
                f"re-shard the teacher's output weight like the student's")
        if h.dtype != w.dtype or h.device != hidden.device or w.device != hidden.device:
            raise ValueError(f"{hn} and {wn} must share one dtype and the student's device {hidden.device}, got "
                             f"{h.dtype}/{h.device} and {w.dtype}/{w.device}")
        def nonfinite(hn: str = hn) -> ValueError:
            return ValueError(f"{hn} has non-finite values (NaN or inf); the teacher's forward diverged: "
                              f"check its inputs and weights")
        checks.require(torch.isfinite(h), nonfinite)
        models.append((h, w))
    return models
