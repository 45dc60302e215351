"""The input checks of the top-k ops (`topk_ids`, `topk_logprobs`, `topk_kl`, `topk_opd_loss` and
the fused head's top-k ops): logits, k, ids and their mask, the teachers' buckets and their
mixture, and the divergence arguments with the deprecated kl=/mix=. The shared primitives and
:class:`DeviceChecks` are in :mod:`._checks`.
"""
from __future__ import annotations

import numbers
import warnings

import torch
import torch.distributed as dist

from megatron_rl_patches.ops._checks import (
    DeviceChecks,
    Weights,
    check_float_tensor,
    check_group,
    check_id_tensor,
    check_weights,
)
from megatron_rl_patches.ops._divergences import DEFAULT_BETA, DEFAULT_DIVERGENCE, check_divergence
from megatron_rl_patches.ops.scoring_plan import checked_k

KL_KINDS = ("reverse", "forward", "mixed")


def check_logits(logits: object, name: str, tp_group: dist.ProcessGroup | None) -> tuple[torch.Size, int]:
    logits = check_float_tensor(logits, name, "of shape [T, V_local]")
    if logits.dim() < 2 or logits.shape[-1] == 0:
        raise ValueError(
            f"{name} must have shape [T, V_local] (or [..., V_local]) with V_local > 0, got {tuple(logits.shape)}"
        )
    check_group(tp_group)
    return logits.shape[:-1], logits.shape[-1]


def check_ids(ids: object, lead: torch.Size, vocab: int, checks: DeviceChecks, ids_mask: object = None) -> int:
    """k of ids [*lead, k]; with `ids_mask` (bool, ids' shape) only the True slots are checked
    (in range, no repeats within a row): the others are padding, whatever their value."""
    ids = check_id_tensor(ids, "ids", "[T, k]")
    if ids.dim() != len(lead) + 1 or ids.shape[:-1] != lead or ids.shape[-1] == 0:
        raise ValueError(
            f"ids must have shape {tuple(lead) + ('k',)} (the logits' leading dims, then k >= 1), "
            f"got {tuple(ids.shape)}"
        )
    k = ids.shape[-1]
    checked_k(k, name="ids.shape[-1] (k)", vocab=vocab)
    ids_mask = check_ids_mask(ids_mask, ids)
    inside = (ids >= 0) & (ids < vocab)
    if ids_mask is not None:
        inside |= ~ids_mask
    checks.require(inside, lambda: ValueError(
        f"ids must be global vocab ids in [0, {vocab}), found {ids[~inside][0].item()}; check vocab_size and tp_group"
        + ("" if ids_mask is None else " (only slots where ids_mask is True are read)")
    ))
    if k > 1:
        distinct = ids.to(torch.long)
        if ids_mask is not None:  # padding as distinct values no id has
            distinct = torch.where(ids_mask, distinct, vocab + torch.arange(k, device=ids.device))
        ordered = distinct.sort(dim=-1).values
        checks.require(ordered[..., 1:] != ordered[..., :-1], lambda: ValueError(
            "ids must not repeat within a row (each id is one bucket); deduplicate them, e.g. use topk_ids"
        ))
    return k


def check_ids_mask(ids_mask: object, ids: torch.Tensor, name: str = "ids") -> torch.Tensor | None:
    """None, or a bool tensor of `ids`' shape and device (True: a real id; False: padding)."""
    if ids_mask is None:
        return None
    if not isinstance(ids_mask, torch.Tensor) or ids_mask.dtype != torch.bool:
        raise TypeError(f"ids_mask must be a bool tensor (True: a real id, False: padding) or None, "
                        f"got {type(ids_mask).__name__ if not isinstance(ids_mask, torch.Tensor) else ids_mask.dtype}")
    if ids_mask.shape != ids.shape or ids_mask.device != ids.device:
        raise ValueError(f"ids_mask must have {name}' shape {tuple(ids.shape)} and device {ids.device}, "
                         f"got {tuple(ids_mask.shape)} on {ids_mask.device}")
    return ids_mask


def check_logprob_values(values: torch.Tensor, name: str, checks: DeviceChecks) -> None:
    """Log-probabilities: <= 0 and not NaN; -inf (probability 0) is legal."""
    ok = values <= 0  # False at NaN and +inf
    checks.require(ok, lambda: ValueError(
        f"{name} must be log-probabilities (<= 0, -inf allowed, no NaN or +inf); found "
        f"{values[~ok].flatten()[0].item()} at {torch.nonzero(~ok)[0].tolist()}; pass log-probs, not logits"
    ))


def check_teachers(
    teacher_logprobs: object, teacher_tail_logprobs: object, ids_shape: torch.Size, checks: DeviceChecks
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Teacher tensors as [n, *ids_shape] and [n, *ids_shape[:-1]] (tail None when derived);
    their values (log-probabilities) checked through `checks`."""
    teacher_logprobs = check_float_tensor(teacher_logprobs, "teacher_logprobs", "[n_teachers, T, k] or [T, k]")
    if teacher_logprobs.shape == ids_shape:
        teacher_logprobs = teacher_logprobs.unsqueeze(0)
        single = True
    elif teacher_logprobs.dim() == len(ids_shape) + 1 and teacher_logprobs.shape[1:] == ids_shape:
        single = False
    else:
        raise ValueError(
            f"teacher_logprobs must have shape {tuple(ids_shape)} (one teacher) or "
            f"(n_teachers, *{tuple(ids_shape)}), like ids; got {tuple(teacher_logprobs.shape)}"
        )
    if teacher_logprobs.shape[0] == 0:
        raise ValueError("teacher_logprobs must hold at least one teacher, got n_teachers = 0")
    check_logprob_values(teacher_logprobs.detach(), "teacher_logprobs", checks)
    if teacher_tail_logprobs is None:
        return teacher_logprobs, None
    teacher_tail_logprobs = check_float_tensor(
        teacher_tail_logprobs, "teacher_tail_logprobs", "[n_teachers, T] or [T], or None"
    )
    expected = tuple(teacher_logprobs.shape[:-1])[1:] if single else tuple(teacher_logprobs.shape[:-1])
    if tuple(teacher_tail_logprobs.shape) != expected:
        raise ValueError(
            f"teacher_tail_logprobs must have shape {expected} to match teacher_logprobs "
            f"{tuple(teacher_logprobs.shape[1:] if single else teacher_logprobs.shape)}, "
            f"got {tuple(teacher_tail_logprobs.shape)}"
        )
    check_logprob_values(teacher_tail_logprobs.detach(), "teacher_tail_logprobs", checks)
    tail = teacher_tail_logprobs.unsqueeze(0) if single else teacher_tail_logprobs
    return teacher_logprobs, tail


def check_mixture(
    teacher_logprobs: object, teacher_tail: object, bucket_shape: torch.Size, weights: Weights,
    dtype: torch.dtype, device: torch.device, checks: DeviceChecks,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The teachers' buckets ([n, ..., k], tails or None) and the log mixture weights [n]."""
    teachers, tails = check_teachers(teacher_logprobs, teacher_tail, bucket_shape, checks)
    return teachers, tails, check_weights(weights, teachers.shape[0], dtype, device, checks,
                                          renormalize_for_one_release=True)


def check_kl_options(kl: object, mix: object) -> float:
    if not isinstance(kl, str) or kl not in KL_KINDS:
        raise ValueError(f"kl must be one of {KL_KINDS}, got {kl!r}")
    if isinstance(mix, bool) or not isinstance(mix, numbers.Real) or not 0.0 <= float(mix) <= 1.0:
        raise ValueError(f"mix must be a float in [0, 1] (the forward-KL share of kl='mixed'), got {mix!r}")
    return float(mix)


_KL_NAMES = {"reverse": "reverse_kl", "forward": "forward_kl", "mixed": "mixed_kl"}


def resolve_divergence(divergence: object, beta: object, alpha: object, kl: object,
                       mix: object) -> tuple[str, float, float]:
    """(name, β, α) of the top-k losses' divergence arguments. `divergence=` supersedes the
    deprecated `kl=`/`mix=`: giving both is a TypeError; `kl=`/`mix=` alone warn
    (DeprecationWarning) and map to reverse_kl / forward_kl / mixed_kl with β = 1 − mix (mix was
    the forward share); nothing given is reverse_kl."""
    legacy = [name for name, value in (("kl", kl), ("mix", mix)) if value is not None]
    if divergence is not None and legacy:
        raise TypeError(f"give divergence= or the deprecated {'/'.join(n + '=' for n in legacy)}, not both; "
                        f"divergence= supersedes them (kl='forward' is divergence='forward_kl')")
    if not legacy:
        return check_divergence(DEFAULT_DIVERGENCE if divergence is None else divergence, beta, alpha)
    warnings.warn("kl=/mix= are deprecated: use divergence= ('reverse_kl', 'forward_kl', 'mixed_kl', 'jsd', ...); "
                  "kl='reverse' is divergence='reverse_kl', kl='forward' divergence='forward_kl', "
                  "kl='mixed', mix=m divergence='mixed_kl', beta=1 - m",
                  DeprecationWarning, stacklevel=3)
    mix = check_kl_options("reverse" if kl is None else kl, 1.0 - DEFAULT_BETA if mix is None else mix)
    _, beta, alpha = check_divergence(DEFAULT_DIVERGENCE, beta, alpha)
    assert kl is None or isinstance(kl, str)  # check_kl_options accepted it
    name = _KL_NAMES["reverse" if kl is None else kl]
    return name, (1.0 - mix if name == "mixed_kl" else beta), alpha
