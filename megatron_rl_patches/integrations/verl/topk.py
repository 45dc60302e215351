"""`verl_topk_kd`: verl's Megatron top-k distillation loss as the exact (k+1)-bucket forward KL.

verl 0.9.1's `compute_forward_kl_topk` (`verl/trainer/distillation/megatron/losses.py`) sums
q_i·(log q_i − log p_i) over the teacher's top-k ids only, with both log-probs clamped at
`log_prob_min_clamp`; its minimum is Q·log Q < 0 (Q: the teacher's top-k mass), and verl's
registered loss then clamps the result at 0 (`verl/trainer/distillation/losses.py`), so once
the student is close to the teacher those tokens give no loss and no gradient (verl RFC #7856).
Here the teacher's remaining mass and the student's remaining mass (from its full logits) form
a (k+1)-th bucket: the KL is >= 0 and exact, so that clamp never bites.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from megatron_rl_patches._log import warn_once
from megatron_rl_patches.integrations.step_mode import student_invariant
from megatron_rl_patches.integrations.verl.entry import verl_teacher
from megatron_rl_patches.integrations.verl.old_rows import old_rows_of
from megatron_rl_patches.integrations.verl.self_teacher import remember_old_rows, self_taught
from megatron_rl_patches.integrations.verl.vocab import whole_vocabulary_step
from megatron_rl_patches.model.arguments import bind
from megatron_rl_patches.ops.invariance import resolve_invariant
from megatron_rl_patches.ops.topk import topk_ids, topk_kl, topk_logprobs

# the micro-batch key (a non-tensor value) under which the patched engine step hands the top-k loss
# the student's invariant mode: verl's loss gets the micro-batch, never the model
MODE = "megatron_rl_patches_invariant"
KEYS = ("distillation_losses", "student_mass", "teacher_mass", "overlap_count", "overlap_token_advantage")

REPLACED = (
    "verl_topk_kd: verl's compute_forward_kl_topk (verl.trainer.distillation.megatron.losses: top-k sum "
    "without a tail, zero-clamped by verl's loss) is replaced by the exact (k+1)-bucket forward KL with "
    "the teachers' and the student's tail buckets: distillation loss values differ from verl's; "
    "set MEGATRON_RL_PATCHES_DISABLE=verl_topk_kd to keep verl's"
)


def _tp_group() -> Any:
    """Megatron's tensor-parallel group, or None (the ops' "no TP") at TP = 1."""
    from megatron.core import parallel_state  # lazy: optional dependency megatron-core

    group = parallel_state.get_tensor_model_parallel_group()
    return group if dist.is_initialized() and dist.get_world_size(group) > 1 else None


def _padded_rows(ids: torch.Tensor) -> torch.Tensor:
    """Rows whose ids repeat: verl pads TP/CP alignment rows with all-zero ids (no top-k there)."""
    if ids.shape[-1] < 2:
        return torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
    ordered = ids.sort(dim=-1).values
    return (ordered[:, 1:] == ordered[:, :-1]).any(dim=-1)


def exact_forward_kl_topk(
    student_logits: torch.Tensor,
    teacher_log_probs: torch.Tensor,
    teacher_ids: torch.Tensor,
    log_prob_min_clamp: float | None = None,
    tp_group: Any = None,
    invariant: bool | None = None,
) -> dict[str, torch.Tensor]:
    """verl's five outputs, each [b, s], for student logits [b, s, V/tp] and the teacher's top-k
    log-probs / ids [b, s, k]: the forward KL between (k+1)-bucket distributions (gradient to the
    student's logits), the student's and teacher's top-k mass, and verl's overlap diagnostics.
    `log_prob_min_clamp` floors the teacher's log-probs, as verl does; the student's are exact (a
    clamp there is what zeroes verl's gradients). Rows with repeated ids (verl's padding) give 0.
    `invariant`: the ops' mode (None: the setting MEGATRON_RL_PATCHES_INVARIANT)."""
    invariant = resolve_invariant(invariant)
    lead, k = student_logits.shape[:-1], teacher_ids.shape[-1]
    if teacher_ids.shape[:-1] != lead or teacher_log_probs.shape != teacher_ids.shape:
        raise ValueError(
            f"teacher ids {tuple(teacher_ids.shape)} and log-probs {tuple(teacher_log_probs.shape)} must be "
            f"[{', '.join(map(str, lead))}, k] like the student's logits {tuple(student_logits.shape)}"
        )
    logits = student_logits.reshape(-1, student_logits.shape[-1])
    ids = teacher_ids.reshape(-1, k).to(device=logits.device, dtype=torch.long)
    teacher = teacher_log_probs.reshape(-1, k).to(device=logits.device, dtype=torch.float32)
    if log_prob_min_clamp is not None:
        teacher = teacher.clamp_min(float(log_prob_min_clamp))
    padded = _padded_rows(ids)
    if bool(padded.any()):  # any valid distinct ids and log-probs; these rows are zeroed below
        stand_in = torch.arange(k, device=ids.device).expand_as(ids)
        ids = torch.where(padded[:, None], stand_in, ids)
        teacher = torch.where(padded[:, None], torch.full_like(teacher, -math.log(k + 1)), teacher)
    student, student_tail = topk_logprobs(logits, ids, tp_group=tp_group, invariant=invariant)
    loss = topk_kl(student, student_tail, teacher, divergence="forward_kl", invariant=invariant)
    loss = torch.where(padded, torch.zeros_like(loss), loss)
    with torch.no_grad():
        keep = (~padded).to(student.dtype)
        q = teacher.exp()
        per_id = q * (teacher - student)
        student_top = topk_ids(logits, k, tp_group=tp_group, invariant=invariant)
        overlap = (ids.unsqueeze(-1) == student_top.unsqueeze(-2)).any(dim=-1) & ~padded[:, None]
        count = overlap.sum(dim=-1)
        advantage = (-per_id * overlap).sum(dim=-1) / count.clamp_min(1)
        out = {
            "student_mass": student.exp().sum(dim=-1) * keep,
            "teacher_mass": q.sum(dim=-1) * keep,
            "overlap_count": count,
            "overlap_token_advantage": torch.where(count > 0, advantage, torch.zeros_like(advantage)),
        }
    result = {"distillation_losses": loss, **out}
    return {key: result[key].reshape(lead) for key in KEYS}


def compute_forward_kl_topk(student_logits: Any, teacher_topk_log_probs: Any, teacher_topk_ids: Any, config: Any,
                            data_format: str, invariant: bool | None = None) -> dict[str, torch.Tensor]:
    """verl 0.9.1's `compute_forward_kl_topk` signature and result (five [b, s/cp] tensors) on the
    exact (k+1)-bucket KL. The teacher's nested [b, s, k] tensors are split for context
    parallelism by verl's own helpers, as verl does. `invariant`: the engine step's mode (the
    micro-batch's, `compute_topk_loss_wrapper`); None (verl's own call of this function, which
    passes no mode): the setting."""
    from verl.models.mcore.util import preprocess_bshd_engine, preprocess_thd_engine  # lazy: optional dependency verl

    if not (getattr(teacher_topk_log_probs, "is_nested", False) and getattr(teacher_topk_ids, "is_nested", False)):
        raise ValueError("verl_topk_kd: teacher_topk_log_probs and teacher_topk_ids must be nested tensors, as verl "
                         "0.9.1 passes them (data['teacher_logprobs'], data['teacher_ids'])")
    if data_format not in ("thd", "bshd"):
        raise ValueError(f"verl_topk_kd: data_format must be 'thd' or 'bshd', got {data_format!r}")
    split = preprocess_thd_engine if data_format == "thd" else preprocess_bshd_engine
    log_probs = split(teacher_topk_log_probs, pre_process=True)[0]
    ids = split(teacher_topk_ids, pre_process=True)[0]
    if not log_probs.shape[:2] == ids.shape[:2] == student_logits.shape[:2]:
        raise ValueError(
            f"verl_topk_kd: teacher top-k {tuple(ids.shape)} after the CP split does not match the student's "
            f"logits {tuple(student_logits.shape)} in [b, s]"
        )
    clamp = getattr(getattr(config, "distillation_loss", None), "log_prob_min_clamp", None)
    return exact_forward_kl_topk(student_logits, log_probs, ids, clamp, _tp_group(), invariant)


def compute_forward_kl_topk_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper for `verl_topk_kd`: arguments bound to verl's own signature; logs once (rank 0)."""
    bound = bind(wrapped, args, kwargs)
    if bound is None:
        return wrapped(*args, **kwargs)  # verl's own error message for a bad call
    warn_once(REPLACED)
    return compute_forward_kl_topk(**bound.arguments)


def compute_topk_loss_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper for `verl_topk_kd` on verl's `compute_topk_loss(config, distillation_config, data,
    student_logits, data_format)` (the top-k loss as verl's logits processor): on the Megatron
    strategy, the exact KL in the mode the micro-batch `data` carries (key `MODE`, put there by
    `forward_step_wrapper`; absent: the setting), with verl's shape check."""
    bound = bind(wrapped, args, kwargs)
    if bound is None or getattr(bound.arguments["config"], "strategy", None) != "megatron":
        return wrapped(*args, **kwargs)
    from verl.utils import tensordict_utils as tu  # lazy: optional dependency verl

    data, student_logits = bound.arguments["data"], bound.arguments["student_logits"]
    warn_once(REPLACED)
    outputs = compute_forward_kl_topk(student_logits, data["teacher_logprobs"], data["teacher_ids"],
                                      bound.arguments["distillation_config"], bound.arguments["data_format"],
                                      tu.get_non_tensor_data(data, MODE, None))
    for key, value in outputs.items():  # verl's own check of its loss's result
        if value.shape != student_logits.shape[:2]:
            raise RuntimeError(f"verl_topk_kd: {key} is {tuple(value.shape)}, expected "
                               f"{tuple(student_logits.shape[:2])}")
    return outputs


def forward_step_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper for `verl_topk_kd` on verl's engine `forward_step(batch_iter, model, ...)`: each
    micro-batch it takes carries the student's invariant mode (key `MODE`; resolved once from
    `model`'s config) to the top-k loss; verl's own micro-batches are left as they are (a copy)."""
    bound = bind(wrapped, args, kwargs)
    named = verl_teacher(instance)  # the variable, read at the engine's door
    step = whole_vocabulary_step(wrapped, instance, named)  # a served teacher's head: the whole vocabulary (`vocab`)
    if bound is None or bound.arguments.get("model") is None:
        return wrapped(*args, **kwargs)
    model = bound.arguments["model"]
    batches = with_mode(bound.arguments["batch_iter"], student_invariant(model))
    taught = named.self_teacher  # `student;context=KEY`: the live self-teacher's rows in each top-k micro-batch
    if taught is not None:
        batches = self_teaching(batches, model, instance, bound.arguments.get("logits_processor_func"), taught,
                                id(bound.arguments["batch_iter"]))
    bound.arguments["batch_iter"] = batches
    return step(*bound.args, **bound.kwargs)


def self_teaching(batches: Any, model: Any, instance: Any, loss_function: Any, named: tuple[str, str | None],
                  pass_id: int) -> Any:
    """verl's micro-batches; in verl's old-log-prob pass (`old_log_prob_pass`) each one's privileged
    sequences scored and kept (`self_teacher.remember_old_rows`, the batch as it is); each top-k
    distillation one with the live self-teacher's rows (`self_teacher.self_taught`, a copy)."""
    from verl.utils import tensordict_utils as tu  # lazy: optional dependency verl

    for batch in batches:
        log_prob_pass = old_log_prob_pass(batch, loss_function)
        old_rows_of(instance).note_step(pass_id if log_prob_pass else None)
        if log_prob_pass:
            remember_old_rows(batch, model, instance, named)
            yield batch
        elif tu.get_non_tensor_data(batch, "distillation_use_topk", False):
            yield self_taught(batch, model, instance, loss_function, named)
        else:
            yield batch


def old_log_prob_pass(batch: Any, loss_function: Any) -> bool:
    """Whether the engine step is on a micro-batch of verl's old-log-prob pass: the actor's
    `compute_log_prob` (`infer_batch`: no loss, no grad) with the entropy the trainer asks for
    there (`calculate_entropy=True`; its reference pass asks for none)."""
    from verl.utils import tensordict_utils as tu  # lazy: optional dependency verl

    return (loss_function is None and not torch.is_grad_enabled()
            and bool(tu.get_non_tensor_data(batch, "calculate_entropy", False)))


def with_mode(batches: Any, invariant: bool) -> Any:
    """verl's micro-batches (TensorDicts), each a shallow copy carrying `invariant` under `MODE`."""
    from verl.utils import tensordict_utils as tu  # lazy: optional dependency verl

    for batch in batches:
        marked = batch.copy()
        tu.assign_non_tensor_data(marked, MODE, invariant)
        yield marked
