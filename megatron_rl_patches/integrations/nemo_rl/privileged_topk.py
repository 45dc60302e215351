"""One privileged top-k pass through a NeMo-RL `Policy` (the student's for the live self-teacher,
NeMo-RL's own teacher `Policy` for the privileged teacher): each sample's context then its
response ids in NeMo-RL's layout, the policy's own `get_topk_logits` over them, and its rows moved
back to the student's response positions."""
# lazy imports: optional dependency nemo_rl
from __future__ import annotations

from typing import Any

import torch

from megatron_rl_patches.integrations.context_fields import tokenizer_vocab
from megatron_rl_patches.integrations.nemo_rl.privileged import privileged_batch
from megatron_rl_patches.teachers.batch import TeacherBatch


def nemo_rl_data(batch: TeacherBatch) -> dict[str, torch.Tensor]:
    """NeMo-RL's distillation fields for `batch`: `input_ids` [B, S'] (zeros past each length),
    `input_lengths`, `token_mask` (1 on the response tokens) and `sample_mask`."""
    width = max((len(s) for s in batch.sequences), default=1)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros(len(batch), width)
    for i, (sequence, start) in enumerate(zip(batch.sequences, batch.response_starts)):
        ids[i, :len(sequence)] = sequence.long()
        mask[i, start:len(sequence)] = 1
    return {"input_ids": ids, "input_lengths": torch.tensor([len(s) for s in batch.sequences]),
            "token_mask": mask, "sample_mask": torch.ones(len(batch))}


def privileged_topk(scorer: Any, data: Any, k: int, *, context: str, values: list[Any] | None, tokenizer: Any,
                    where: str, block: str, who: str, micro_batch_size: int | None = None,
                    timer: Any = None) -> Any:
    """`topk_logits` / `topk_indices` [B, S, k] at the student's positions in `data` (position s: the
    top-k predicting token s + 1) from `scorer.get_topk_logits` over each sample's context (`data`'s
    field `context`, else `values`, the rollout's; ids, or text through `tokenizer`) then response.
    Bad contexts are refused (naming `where` and `block`) before `scorer` runs; `data` untouched."""
    # lazy: import cost: the served teacher's module (its client) only when a privileged pass scores
    from megatron_rl_patches.integrations.nemo_rl.served_teacher import filler, rows_of

    ids, lengths, starts = rows_of(data)
    batch = TeacherBatch(sequences=[ids[i, :int(lengths[i])] for i in range(ids.shape[0])],
                         response_starts=starts)
    vocab = tokenizer_vocab(tokenizer) if tokenizer is not None else None
    scored = privileged_batch(batch, data, context, values, tokenizer, vocab, where, block)
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict  # lazy: optional dependency nemo_rl

    got = scorer.get_topk_logits(BatchedDataDict(nemo_rl_data(scored)), k=k, micro_batch_size=micro_batch_size,
                                 timer=timer)
    top_values, top_ids = got["topk_logits"], got["topk_indices"]
    if not isinstance(top_values, torch.Tensor) or top_values.dim() != 3 or top_values.shape[0] != len(batch) \
            or top_values.shape[-1] != k or top_values.shape[1] < max(len(s) for s in scored.sequences):
        shown = tuple(top_values.shape) if isinstance(top_values, torch.Tensor) else type(top_values).__name__
        raise ValueError(f"{where}: the {who}'s get_topk_logits answered topk_logits {shown} for a privileged "
                         f"batch of {len(batch)} samples and k={k}: expected [B, S', k]")
    out_values, out_ids = filler(ids.shape[0], ids.shape[1], int(k))
    for i, (start, own) in enumerate(zip(starts, scored.response_starts)):
        rows = batch.response_rows(i)
        out_values[i, start - 1:start - 1 + rows] = top_values[i, own - 1:own - 1 + rows].detach().float().cpu()
        out_ids[i, start - 1:start - 1 + rows] = top_ids[i, own - 1:own - 1 + rows].detach().long().cpu()
    return BatchedDataDict({"topk_logits": out_values, "topk_indices": out_ids})
