"""score_at_layout / topk_at_layout: the student's rows on each rank scored by a teacher built at
its own layout.

Every rank of a teacher replica (its tp x pp ranks) must take part in the same forward on the
same tokens, but each holds its own student micro-batch: the replica's micro-batches are gathered
(rows padded on the right to the longest, concatenated in rank order), the teacher runs once on
them (stage by stage at pp > 1: pipeline.replica_scores), and each rank keeps the scores of its
own rows (every rank of the replica holds the whole result: after the vocab-parallel reduction
at pp=1, broadcast from the last stage at pp > 1). Right padding never changes a real token's
score: attention is causal."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from megatron_rl_patches.inference.residency.placement import forward_device
from megatron_rl_patches.inference.teacher_layout.entry import enter
from megatron_rl_patches.inference.teacher_layout.gather import GroupBatch, gathered
from megatron_rl_patches.inference.teacher_layout.groups import TeacherGroups
from megatron_rl_patches.inference.teacher_layout.layout import TeacherLayout
from megatron_rl_patches.inference.teacher_layout.pipeline import replica_scores
from megatron_rl_patches.model.chunks import is_last_stage, unwrap
from megatron_rl_patches.ops import log_probs_and_entropy, topk_ids, topk_logprobs


def _causal_mask(rows: int, length: int) -> torch.Tensor:
    """megatron-core's attention mask (True: masked out) of causal attention, [rows, 1, s, s]."""
    return torch.ones(length, length, dtype=torch.bool).triu(1)[None, None].expand(rows, 1, length, length)


def _replica_scores(model: torch.nn.Module, groups: TeacherGroups, tokens: torch.Tensor, batch: GroupBatch,
                    score: Callable[[torch.Tensor, torch.device], list[torch.Tensor]],
                    widths: list[tuple[int, ...]]) -> list[torch.Tensor] | None:
    """`score(logits [sum rows * max length, V / tp], device)` of the replica's gathered batch on
    every rank of the replica, fp32 [sum rows * max length, *width] per width (None when the whole
    replica has no token)."""
    all_tokens = gathered(groups, tokens, batch)
    total, longest = all_tokens.shape
    if total == 0 or longest == 0:
        return None
    device = forward_device(model)  # a swap / stream teacher's parameters read host copies between forwards
    position_ids = torch.arange(longest).expand(total, longest)
    inputs = (all_tokens.to(device), position_ids.to(device), _causal_mask(total, longest).to(device))
    return replica_scores(model, groups, inputs, lambda logits: score(logits.reshape(total * longest, -1), device),
                          [(total * longest, *width) for width in widths])


def _padding_mask(batch: GroupBatch, device: torch.device) -> torch.Tensor | None:
    """The ops' row_mask of the gathered batch (True: a real token), None when no row is padded:
    a mask costs the ops a masked pass over the logits (a quarter of a CPU step, bench
    teacher-layout), and rows of equal length need none."""
    real = batch.real()
    return None if bool(real.all()) else real.to(device)


def _mine(values: torch.Tensor, groups: TeacherGroups, batch: GroupBatch) -> torch.Tensor:
    """This rank's rows of a [sum rows * max length, ...] result, [rows, length, ...]."""
    first, rows, length = batch.my_rows(groups)
    longest = max(s for _, s in batch.shapes)
    grid = values.reshape(-1, longest, *values.shape[1:])
    return grid[first: first + rows, :length].float()


def score_at_layout(
    chunks: Any,
    tokens: torch.Tensor,
    labels: torch.Tensor,
    *,
    layout: TeacherLayout | None = None,
    temperature: float = 1.0,
    vocab_size: int | None = None,
    invariant: bool | None = None,
) -> torch.Tensor:
    """The teacher's log p(labels[i, t] | tokens[i, :t+1]) for this rank's rows, [rows, length] fp32.

    `chunks`: what build_inference_model_from_hf(path, layout=TeacherLayout(tp=N)) returned;
    `tokens` / `labels`: this rank's student micro-batch (Megatron's convention: labels[t] is the
    token after tokens[t]); rows and lengths may differ between ranks, a rank may have no rows.
    A collective over the teacher replica's ranks: every rank of the default group calls
    it once per micro-batch. `layout`: checked against the chunks' own when given; `vocab_size`:
    the real vocab (default: the checkpoint's, so padded vocab rows get no mass); `temperature`
    divides the logits (the same on every rank). Each rank's arguments and ids (tokens within the
    checkpoint's vocabulary, labels within `vocab_size`) are checked, then agreed over the replica
    before any other collective (entry.enter): a failure or a differing value on any rank is the
    same error on every rank of the replica. `invariant`: the vocabulary ops' mode — the
    student's, for a teacher scored beside it (None: the setting MEGATRON_RL_PATCHES_INVARIANT; a
    teacher's own config is never read), agreed like the rest."""
    log_probs, _ = score_with_entropy_at_layout(chunks, tokens, labels, layout=layout, temperature=temperature,
                                                vocab_size=vocab_size, with_entropy=False, invariant=invariant)
    return log_probs


def score_with_entropy_at_layout(
    chunks: Any,
    tokens: torch.Tensor,
    labels: torch.Tensor,
    *,
    layout: TeacherLayout | None = None,
    temperature: float = 1.0,
    vocab_size: int | None = None,
    with_entropy: bool = True,
    invariant: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """score_at_layout's log-probs and, with `with_entropy`, the entropy of the teacher's
    distribution (logits / temperature, over the real vocab) at each of this rank's positions,
    [rows, length] fp32 each (None without `with_entropy`). `invariant` as score_at_layout's."""
    call = enter("score_at_layout", chunks, layout, tokens, {"labels": labels}, temperature=temperature,
                 vocab_size=vocab_size, match={"with_entropy": bool(with_entropy)}, invariant=invariant)
    model, groups, batch = call.model, call.groups, call.batch

    def score(logits: torch.Tensor, device: torch.device) -> list[torch.Tensor]:
        log_probs, entropy = log_probs_and_entropy(logits, all_labels.to(device), tp_group=groups.tp_group,
                                                   temperature=call.temperature, with_entropy=with_entropy,
                                                   vocab_size=call.vocab, row_mask=_padding_mask(batch, device),
                                                   invariant=call.invariant)
        return [log_probs] if entropy is None else [log_probs, entropy]

    with torch.no_grad():
        all_labels = gathered(groups, labels, batch).reshape(-1)
        scores = _replica_scores(model, groups, tokens, batch, score, [(), ()] if with_entropy else [()])
    if scores is None:
        empty = torch.zeros(*batch.shapes[groups.replica_rank], dtype=torch.float32)
        return empty, empty.clone() if with_entropy else None
    return _mine(scores[0], groups, batch), _mine(scores[1], groups, batch) if with_entropy else None


def topk_at_layout(
    chunks: Any,
    tokens: torch.Tensor,
    ids: torch.Tensor,
    *,
    layout: TeacherLayout | None = None,
    temperature: float = 1.0,
    vocab_size: int | None = None,
    ids_mask: torch.Tensor | None = None,
    invariant: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's log-probs at `ids` [rows, length, k] (e.g. the student's top-k ids per
    position, the same k on every rank) for this rank's rows, [rows, length, k] fp32, and the log
    of the remaining mass [rows, length] (from the complement's log-sum-exp: the tail of top-k
    on-policy distillation); normalized over the full vocab. `ids_mask` (bool, the ids' shape):
    False slots are padding, log-prob -inf, their mass left in the tail (as `topk_logprobs`).
    Otherwise (`invariant` too) as score_at_layout."""
    others = {"ids": ids} if ids_mask is None else {"ids": ids, "ids_mask": ids_mask}
    call = enter("topk_at_layout", chunks, layout, tokens, others, temperature=temperature, vocab_size=vocab_size,
                 match={"ids_mask given": ids_mask is not None}, invariant=invariant)
    model, groups, batch = call.model, call.groups, call.batch

    def score(logits: torch.Tensor, device: torch.device) -> list[torch.Tensor]:
        mask = None if all_mask is None else all_mask.reshape(logits.shape[0], -1).to(device=device, dtype=torch.bool)
        logp, tail = topk_logprobs(logits, all_ids.reshape(logits.shape[0], -1).to(device), tp_group=groups.tp_group,
                                   temperature=call.temperature, vocab_size=call.vocab, ids_mask=mask,
                                   row_mask=_padding_mask(batch, device),  # padding's ids are never read
                                   invariant=call.invariant)
        return [logp, tail]

    with torch.no_grad():
        all_ids = gathered(groups, ids, batch)
        all_mask = None if ids_mask is None else gathered(groups, ids_mask.long(), batch)
        scores = _replica_scores(model, groups, tokens, batch, score, [(batch.k,), ()])
    if scores is None:
        rows, length = batch.shapes[groups.replica_rank]
        return torch.zeros(rows, length, batch.k), torch.zeros(rows, length)
    return _mine(scores[0], groups, batch), _mine(scores[1], groups, batch)


def select_topk_at_layout(
    chunks: Any,
    tokens: torch.Tensor,
    labels: torch.Tensor,
    k: int,
    *,
    layout: TeacherLayout | None = None,
    temperature: float = 1.0,
    vocab_size: int | None = None,
    invariant: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's own top-k: for this rank's rows its log p(labels) [rows, length] fp32 and the
    ids of its k largest logits per position [rows, length, k] int64 (descending, ties to the lower
    id, padded vocab rows never chosen; the same k on every rank): the first pass of a teacher with
    another tokenizer (its own top-k at chunk starts), whose log-probs at those ids `topk_at_layout`
    then gives. Otherwise (`invariant` too) as score_at_layout."""
    def checks(model: torch.nn.Module, vocab: int) -> None:
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= vocab:
            raise ValueError(f"k must be an int in [1, {vocab}] (the scored vocabulary), got {k!r}")
        if int(unwrap(model).vocab_size) >= 2 ** 24:
            raise ValueError("select_topk_at_layout serves vocabularies below 2**24 ids (its ids travel as float32)")

    call = enter("select_topk_at_layout", chunks, layout, tokens, {"labels": labels}, temperature=temperature,
                 vocab_size=vocab_size, checks=checks, match={"k": k if isinstance(k, int) else None},
                 invariant=invariant)
    model, groups, batch = call.model, call.groups, call.batch

    def score(logits: torch.Tensor, device: torch.device) -> list[torch.Tensor]:
        mask = _padding_mask(batch, device)
        log_probs, _ = log_probs_and_entropy(logits, all_labels.to(device), tp_group=groups.tp_group,
                                             temperature=call.temperature, with_entropy=False, vocab_size=call.vocab,
                                             row_mask=mask, invariant=call.invariant)
        ids = topk_ids(logits, k, tp_group=groups.tp_group, vocab_size=call.vocab, row_mask=mask,
                       invariant=call.invariant)
        return [log_probs, ids.float()]  # the scores' float32 carries ids exactly below 2**24

    with torch.no_grad():
        all_labels = gathered(groups, labels, batch).reshape(-1)
        scores = _replica_scores(model, groups, tokens, batch, score, [(), (k,)])
    if scores is None:
        rows, length = batch.shapes[groups.replica_rank]
        return torch.zeros(rows, length), torch.zeros(rows, length, k, dtype=torch.int64)
    return _mine(scores[0], groups, batch), _mine(scores[1], groups, batch).long()


class _HiddenOut(torch.nn.Module):
    """Stands in for a GPTModel's output layer: returns the final hidden states it is given (the
    model then hands them out [b, s, hidden] where it would hand out logits); it shows the layer's
    weight to the code around the call that reads it."""

    def __init__(self, output_layer: Any) -> None:
        super().__init__()
        self.weight = getattr(output_layer, "weight", None)
        self.bias = None

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
        return hidden_states, None


def hidden_at_layout(chunks: Any, tokens: torch.Tensor, *, layout: TeacherLayout | None = None) -> torch.Tensor:
    """The teacher's final hidden states (its output layer's input, after the final norm) at this
    rank's rows, [rows, length, hidden] fp32: with `output_weight_at_layout` what a full-vocabulary
    divergence (`lm_head_divergence`'s teacher_hidden / teacher_weight) needs of a teacher at its
    own layout, and nothing [T, V]-sized crosses ranks. A collective as score_at_layout."""
    call = enter("hidden_at_layout", chunks, layout, tokens, {})
    model, groups, batch = call.model, call.groups, call.batch
    inner = unwrap(model)
    width = int(inner.config.hidden_size)
    swapped = is_last_stage(inner)  # only the last stage has an output layer
    if swapped:
        output_layer = inner.output_layer
        inner.output_layer = _HiddenOut(output_layer)
    try:
        with torch.no_grad():
            scores = _replica_scores(model, groups, tokens, batch, lambda hidden, device: [hidden], [(width,)])
    finally:
        if swapped:
            inner.output_layer = output_layer
    if scores is None:
        return torch.zeros(*batch.shapes[groups.replica_rank], width, dtype=torch.float32)
    return _mine(scores[0], groups, batch)


def output_weight_at_layout(chunks: Any, *, layout: TeacherLayout | None = None) -> torch.Tensor:
    """The teacher's whole output weight [padded vocab, hidden] in its dtype on every rank (the
    tensor-parallel shards gathered; the last stage's, sent over each pipeline): slice it to the
    student's vocabulary shard for `lm_head_divergence` (rows [r·V/tp, (r+1)·V/tp) of a student
    at TP=tp; pass the real `vocab_size` so padded rows get no mass). A collective over every rank
    of the teacher's replica (each holds V / tp · hidden of it afterwards, not before)."""
    call = enter("output_weight_at_layout", chunks, layout, None, {})
    model, groups = call.model, call.groups
    inner = unwrap(model)
    rows, width = int(inner.vocab_size) // groups.tp_size, int(inner.config.hidden_size)
    parameter, device = next(model.parameters()), forward_device(model)
    with torch.no_grad():
        shard = None
        if is_last_stage(inner):  # a swap / stream teacher's: its host copy, sent from the device
            shard = (inner.shared_embedding_or_output_weight() if inner.share_embeddings_and_output_weights
                     else inner.output_layer.weight).detach().to(device)
        if groups.pp_size > 1:
            held = torch.empty(rows, width, dtype=parameter.dtype, device=device)
            if shard is not None:
                held.copy_(shard)
            dist.broadcast(held, src=groups.pp_ranks()[-1], group=groups.pp_group)
            shard = held
        assert shard is not None and tuple(shard.shape) == (rows, width), "the output layer's shard"
        parts = [torch.empty_like(shard) for _ in range(groups.tp_size)]
        dist.all_gather(parts, shard.contiguous(), group=groups.tp_group)
    return torch.cat(parts)
