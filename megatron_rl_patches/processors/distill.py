"""Output processors for full-vocabulary distillation through GPTModel's `output_processor=` hook:
teachers return their final hidden states (no logits), the student returns its per-token
divergence from them, computed by :func:`megatron_rl_patches.lm_head_divergence` over vocabulary
tiles — no model's [s, b, V/tp] logits ever exist.

    with torch.no_grad():
        hid = [t(tokens, pos, mask, output_processor=hidden_output_processor()) for t in teachers]
    div = student(tokens, pos, mask, output_processor=divergence_output_processor(divergence="jsd"),
                  output_processor_context={"teacher_hidden": hid,
                                            "teacher_weight": [t.output_layer.weight for t in teachers]})

A teacher's output weight is `output_layer.weight`, or with tied embeddings
(`share_embeddings_and_output_weights`) `embedding.word_embeddings.weight`
(`shared_embedding_or_output_weight()` returns the embedding's weight whenever the model has the
first pipeline stage, tied or not).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from megatron_rl_patches.ops._divergences import DEFAULT_ALPHA, DEFAULT_BETA, DEFAULT_DIVERGENCE
from megatron_rl_patches.ops.divergence import lm_head_divergence
from megatron_rl_patches.ops.divergence_checks import check_divergence_options
from megatron_rl_patches.ops.kernels.sources import gather_rows
from megatron_rl_patches.processors.heads import (
    ProcessorCall,
    check_options,
    logit_multiplier,
    output_tp_group,
    read_context,
    token_rows,
    wait_for_output_weight,
)

__all__ = ["hidden_output_processor", "divergence_output_processor"]

_DIVERGENCE_CONTEXT = ("teacher_hidden", "teacher_weight", "keep_mask", "temperature", "row_mask")


def _no_mup(config: Any, who: str) -> None:
    """A MuP output multiplier scales one model's logits only; the divergence's one temperature
    cannot express that, so it is refused rather than applied to every model."""
    if logit_multiplier(config) != 1.0:
        raise ValueError(f"{who}: config.use_mup scales this model's logits by mup_output_mult, which the "
                         "full-vocabulary divergence cannot apply to one model only; disable use_mup for distillation")


def hidden_output_processor() -> Callable[..., torch.Tensor]:
    """A processor returning a (teacher) model's final hidden states [b, s, H] — after the final
    norm, what its output layer would take — instead of logits. Inference only: detached. Under
    sequence parallelism every rank's rows are gathered (all-gather of [s, b, H] over the TP group)."""

    def process(*, hidden_states, output_layer, config=None, **_):
        if hidden_states.dim() != 3:
            raise ValueError(f"hidden_states must be [s, b, h], got shape {tuple(hidden_states.shape)}")
        _no_mup(config, "hidden_output_processor")
        # the caller reads this model's output weight next: with overlap-param-gather its
        # all-gather must be waited for, as calling the output layer would
        wait_for_output_weight(output_layer, hidden_states)
        sequence_parallel = bool(getattr(output_layer, "sequence_parallel", False))
        rows = gather_rows(hidden_states.detach(), output_tp_group(output_layer), sequence_parallel)
        # a copy, [b, s, H] contiguous: the hidden states megatron-core hands over may live in a
        # buffer that the model's next forward reuses
        return rows.transpose(0, 1).clone(memory_format=torch.contiguous_format)

    return process


def divergence_output_processor(
    *,
    divergence: str = DEFAULT_DIVERGENCE,
    beta: float = DEFAULT_BETA,
    alpha: float = DEFAULT_ALPHA,
    teacher_weights: Sequence[float] | torch.Tensor | None = None,
    temperature: float = 1.0,
    vocab_size: int | None = None,
    chunk_size: int | None = None,
) -> Callable[..., torch.Tensor]:
    """A processor returning the student's per-token divergence [b, s] from the teachers whose
    final hidden states ([b, s, H_t], e.g. from :func:`hidden_output_processor`) and output
    weights ([V/tp, H_t], the same vocabulary sharding as the student's) come through
    `output_processor_context={"teacher_hidden": t or [t...], "teacher_weight": w or [w...]}`,
    optionally with "keep_mask" ([b, s, V/tp] bool), "temperature" ([b, s], multiplied with
    `temperature`) and "row_mask" ([b, s] bool, e.g. the response tokens: the other tokens'
    divergence is 0 and they never meet the head). Options as :func:`megatron_rl_patches.lm_head_divergence`."""
    check_divergence_options(divergence, beta, alpha)
    check_options(temperature, vocab_size, chunk_size)

    def process(*, hidden_states, output_layer, output_weight=None, config=None, context=None, **_):
        ctx = read_context(context, _DIVERGENCE_CONTEXT)
        if "teacher_hidden" not in ctx or "teacher_weight" not in ctx:
            raise ValueError("divergence_output_processor needs output_processor_context={'teacher_hidden': ..., "
                             "'teacher_weight': ...}: the teachers' hidden_output_processor() results "
                             "and output weights")
        _no_mup(config, "divergence_output_processor")
        call = ProcessorCall(hidden_states, output_layer, output_weight, None, config, temperature, ctx)
        keep_mask = ctx.get("keep_mask")
        if keep_mask is not None:
            keep_mask = token_rows(keep_mask, "output_processor_context['keep_mask']", call.batch, call.seq)
        row_mask = ctx.get("row_mask")
        if row_mask is not None:
            row_mask = token_rows(row_mask, "output_processor_context['row_mask']", call.batch, call.seq)
        value = lm_head_divergence(
            call.hidden, call.weight, _teacher_rows(ctx["teacher_hidden"], ctx["teacher_weight"], call),
            ctx["teacher_weight"],
            divergence=divergence, beta=beta, alpha=alpha, teacher_weights=teacher_weights,
            temperature=call.temperature, vocab_size=vocab_size, tp_group=call.tp_group,
            sequence_parallel=call.sequence_parallel, keep_mask=keep_mask, chunk_size=chunk_size,
            row_mask=row_mask,
        )
        return call.to_batch(value)

    return process


def _teacher_rows(teacher_hidden: Any, teacher_weight: Any, call: ProcessorCall) -> torch.Tensor | list[torch.Tensor]:
    """[b, s, H_t] per teacher as the student's rows: (s, b) order, this rank's sequence slice
    under sequence parallelism (the op gathers every model's rows alike), in the dtype of the
    teacher's output weight (see `_in_weight_dtype`)."""
    single = isinstance(teacher_hidden, torch.Tensor)
    if not single and not isinstance(teacher_hidden, (list, tuple)):
        raise TypeError("output_processor_context['teacher_hidden'] must be a tensor [b, s, H_t] or a list of them, "
                        f"got {type(teacher_hidden).__name__}")
    weights = [teacher_weight] if isinstance(teacher_weight, torch.Tensor) else teacher_weight
    rows = []
    for j, hidden in enumerate([teacher_hidden] if single else teacher_hidden):
        name = "output_processor_context['teacher_hidden']" + ("" if single else f"[{j}]")
        weight = weights[j] if isinstance(weights, (list, tuple)) and j < len(weights) else None
        flat = _in_weight_dtype(token_rows(hidden, name, call.batch, call.seq), weight)
        if call.sequence_parallel:
            per = flat.size(0) // call.tp_world
            rank = dist.get_rank(call.tp_group)
            flat = flat[rank * per : (rank + 1) * per]
        rows.append(flat)
    return rows[0] if single else rows


def _in_weight_dtype(hidden: torch.Tensor, weight: Any) -> torch.Tensor:
    """A teacher's hidden states in its output weight's dtype: what the teacher's own output layer
    computes in. A bf16 teacher in Float16Module hands its hidden states back upcast to fp32
    (losslessly), so they come back to bf16 exactly; a pair the op cannot take stays as given."""
    if (isinstance(weight, torch.Tensor) and isinstance(hidden, torch.Tensor) and weight.is_floating_point()
            and hidden.is_floating_point() and hidden.dtype != weight.dtype):
        return hidden.to(weight.dtype)
    return hidden
