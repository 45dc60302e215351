"""Cross-tokenizer distillation losses for hand-written loops. The token-level reverse-KL term
from the spread teacher signal, and the (k+1)-bucket divergence at chunk starts over shared byte
strings, through the fused head (`lm_head_topk_ids`, `lm_head_topk_logprobs`, `topk_kl`), and the
full divergence over every shared string (`lm_head_divergence` on each model's layer re-indexed
by string): no model's [T, V] logits ever exist."""
from __future__ import annotations

from typing import Any

import torch

from megatron_rl_patches.cross_tokenizer.alignment import Alignment
from megatron_rl_patches.cross_tokenizer.loss_inputs import check_loss_inputs
from megatron_rl_patches.cross_tokenizer.spreading import spread_chunk_log_probs
from megatron_rl_patches.cross_tokenizer.vocabulary import SharedVocabulary
from megatron_rl_patches.ops.divergence import lm_head_divergence
from megatron_rl_patches.ops.lm_head import lm_head_log_probs_and_entropy, lm_head_topk_ids, lm_head_topk_logprobs
from megatron_rl_patches.ops.topk import topk_kl

__all__ = ["alive_strings", "bucket_log_probs", "chunk_reverse_kl", "chunk_start_full_divergence",
           "chunk_start_topk_divergence"]


def chunk_reverse_kl(student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor,
                     alignment: Alignment) -> torch.Tensor:
    """Per student token [n_student]: r_i = log pS(y_i) − spread_i (the value; a sequence's sum is
    Σ_j ℓS_j − ℓT_j, the sampled reverse-KL estimate), with gradient r_i·∇log pS(y_i) (the
    on-policy distillation gradient with discount 0). Tokens of chunk −1: 0, no gradient."""
    spread = spread_chunk_log_probs(student_log_probs, teacher_log_probs, alignment)
    s = student_log_probs
    r = (s.detach() - spread).to(s.dtype)
    return r + r * (s - s.detach())


def bucket_log_probs(id_log_probs: torch.Tensor, mask: torch.Tensor, alive: torch.Tensor) -> torch.Tensor:
    """log P(bucket) [R, k] from the log-probs of each bucket's ids [R, k·D] (`mask`: the real ids,
    from `SharedVocabulary.bucket_ids`); −inf for the buckets `alive` [R, k] marks dead."""
    rows, k = alive.shape
    lp = torch.where(mask, id_log_probs, -torch.inf).reshape(rows, k, -1)
    # a dead bucket's slots get finite fillers: logsumexp of all −inf would send NaN backward
    grouped = torch.logsumexp(torch.where(alive[..., None], lp, 0.0), dim=-1).clamp(max=0.0)
    return torch.where(alive, grouped, -torch.inf)


def _bucket_log_probs(hidden, weight, ids, mask, alive, temperature, chunk_size):
    """log P(bucket) [R, k] (−inf for dead buckets) and the exact log tail mass [R]."""
    lp, tail = lm_head_topk_logprobs(hidden, weight, ids, ids_mask=mask, temperature=temperature,
                                     chunk_size=chunk_size)
    return bucket_log_probs(lp, mask, alive), tail


def alive_strings(strings: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's top-k ids' strings [R, k] (−1: not shared) sorted, and which are buckets: the
    shared ones, each string once."""
    strings, _ = torch.sort(strings, dim=-1)
    alive = (strings >= 0) & torch.cat([torch.ones_like(strings[:, :1], dtype=torch.bool),
                                        strings[:, 1:] != strings[:, :-1]], dim=1)
    return strings, alive


def _checked_chunk_starts(hidden: torch.Tensor, weight: torch.Tensor, teacher_hidden: torch.Tensor,
                          teacher_weight: torch.Tensor, alignment: Alignment,
                          shared: SharedVocabulary) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inputs checked, then the chunk starts' student and teacher rows and the zero output
    [n_student] (float64 for float64 hidden, else float32) the chunk-start losses fill."""
    check_loss_inputs(hidden, weight, teacher_hidden, teacher_weight, alignment, shared)
    s_rows, t_rows = alignment.chunk_starts()
    out = torch.zeros(hidden.size(0), dtype=torch.float64 if hidden.dtype == torch.float64 else torch.float32,
                      device=hidden.device)
    return s_rows, t_rows, out


def chunk_start_topk_divergence(hidden: torch.Tensor, weight: torch.Tensor, teacher_hidden: torch.Tensor,
                                teacher_weight: torch.Tensor, alignment: Alignment, shared: SharedVocabulary,
                                *, k: int = 8, temperature: float = 1.0, chunk_size: int | None = None,
                                **divergence: Any) -> torch.Tensor:
    """Per student token [n_student]: at the first token of each chunk, the divergence (`topk_kl`'s
    options: divergence=, beta=, alpha=) between the two models' (k+1)-bucket distributions over
    byte strings; 0 elsewhere (those positions get the token-level signal only). The buckets: the
    shared strings of the teacher's k most likely ids (each bucket sums every id of its string on
    each side; a string only the teacher has falls into the tail), and one exact tail per model.

    hidden [n_student, H] / teacher_hidden [n_teacher, H_t]: the rows that predict each student /
    teacher token (row i scores token i); weight / teacher_weight the output layers [V, H]. The
    gradient flows to the student's hidden and weight only."""
    s_rows, t_rows, out = _checked_chunk_starts(hidden, weight, teacher_hidden, teacher_weight, alignment, shared)
    if s_rows.numel() == 0:
        return out + 0.0 * hidden.sum()
    s_rows, t_rows = s_rows.to(hidden.device), t_rows.to(hidden.device)
    with torch.no_grad():
        t_hidden = teacher_hidden.detach()[t_rows]
        top = lm_head_topk_ids(t_hidden, teacher_weight.detach(), k, chunk_size=chunk_size)
        strings, alive = alive_strings(shared.string_of(top, "teacher"))  # a padded row's id: the tail
        t_ids, t_mask = shared.bucket_ids(strings, alive, "teacher")
        s_ids, s_mask = shared.bucket_ids(strings, alive, "student")
        t_lp, t_tail = _bucket_log_probs(t_hidden, teacher_weight.detach(), t_ids, t_mask, alive, temperature,
                                         chunk_size)
    s_lp, s_tail = _bucket_log_probs(hidden[s_rows], weight, s_ids, s_mask, alive, temperature, chunk_size)
    value = topk_kl(s_lp, s_tail, t_lp.to(s_lp.dtype), t_tail.to(s_lp.dtype), ids_mask=alive, **divergence)
    return out.index_put((s_rows,), value.to(out.dtype))


def _string_head(hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor,
                 repeated: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One model's output layer over byte strings: (hidden' [R, H + m + 1], weight' [n_single + m + 1,
    H + m + 1]) whose logits are z of the string's one id (the `single` strings, in string
    order), then the log-sum-exp of the repeated strings' ids (m of them, computed here: few ids),
    then the log-sum-exp of every id of no shared string (the tail; through the fused head)."""
    count = offsets.diff()
    single = torch.nonzero(~repeated).squeeze(1)
    rows = weight[ids[offsets[single]]]
    lse = []
    for g in torch.nonzero(repeated).squeeze(1).tolist():
        group = ids[offsets[g]: offsets[g] + count[g]]
        lse.append(torch.logsumexp(hidden @ weight[group].T, dim=-1))
    outside = torch.ones(weight.size(0), dtype=torch.bool, device=weight.device)
    outside[ids] = False
    rest = torch.nonzero(outside).squeeze(1)
    if rest.numel():
        first = torch.zeros(hidden.size(0), dtype=torch.long, device=hidden.device)
        lp, _ = lm_head_log_probs_and_entropy(hidden, weight[rest], first)
        tail = hidden @ weight[rest[0]] - lp  # z of the first outside id minus its log-prob: the LSE
    else:  # every id is shared: an empty tail (a finite stand-in for −inf whose e^x is exactly 0)
        tail = torch.full((hidden.size(0),), torch.finfo(hidden.dtype).min / 16, dtype=hidden.dtype,
                          device=hidden.device)
    extra = torch.stack([*lse, tail], dim=1).to(hidden.dtype)
    m = extra.size(1)
    new_hidden = torch.cat([hidden, extra], dim=1)
    top = torch.cat([rows, rows.new_zeros(rows.size(0), m)], dim=1)
    bottom = torch.cat([rows.new_zeros(m, rows.size(1)), torch.eye(m, dtype=rows.dtype, device=rows.device)], dim=1)
    return new_hidden, torch.cat([top, bottom], dim=0)


def chunk_start_full_divergence(hidden: torch.Tensor, weight: torch.Tensor, teacher_hidden: torch.Tensor,
                                teacher_weight: torch.Tensor, alignment: Alignment, shared: SharedVocabulary,
                                *, chunk_size: int | None = None, **divergence: Any) -> torch.Tensor:
    """Per student token [n_student]: at the first token of each chunk, `lm_head_divergence` (its
    options: divergence=, beta=, alpha=) between the two models' distributions over every shared
    byte string (each summing its ids on each side) plus one exact tail per model (the mass on ids
    of no shared string, padded weight rows included); 0 elsewhere. Each model's layer is
    re-indexed by string (a copy of its shared weight rows, never [T, V] logits). Arguments as
    `chunk_start_topk_divergence`; the gradient flows to the student's hidden and weight only."""
    s_rows, t_rows, out = _checked_chunk_starts(hidden, weight, teacher_hidden, teacher_weight, alignment, shared)
    if s_rows.numel() == 0:
        return out + 0.0 * hidden.sum()
    device = hidden.device
    s_off, t_off = shared.student_offsets.to(device), shared.teacher_offsets.to(device)
    repeated = (s_off.diff() > 1) | (t_off.diff() > 1)
    h_s, w_s = _string_head(hidden[s_rows.to(device)], weight, shared.student_ids.to(device), s_off, repeated)
    with torch.no_grad():
        h_t, w_t = _string_head(teacher_hidden.detach()[t_rows.to(device)], teacher_weight.detach(),
                                shared.teacher_ids.to(device), t_off, repeated)
    value = lm_head_divergence(h_s, w_s, h_t, w_t, chunk_size=chunk_size, **divergence)
    return out.index_put((s_rows.to(device),), value.to(out.dtype))
