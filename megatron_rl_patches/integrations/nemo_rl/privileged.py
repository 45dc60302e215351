"""A privileged teacher's batch in NeMo-RL (`privileged_batch`): each sample's context (NeMo-RL's
batch field KEY, else the last rollout's, kept by `rollout_contexts`) before its response ids, for
the served teacher (`served_teacher`) and the live self-teacher (`self_teacher`) alike."""
from __future__ import annotations

from typing import Any

import torch

from megatron_rl_patches.integrations.context_fields import field_contexts
from megatron_rl_patches.teachers.batch import TeacherBatch
from megatron_rl_patches.teachers.context import with_context


def privileged_batch(batch: TeacherBatch, data: Any, key: str, rollout_values: list[Any] | None, tokenizer: Any,
                     vocab: int | None, where: str, in_setup: str) -> TeacherBatch:
    """`with_context(batch, contexts)`: the contexts `data[key]` (one per sample) or, without the
    field, `rollout_values`; text through `tokenizer`, ids checked against `vocab`. Every refusal
    names `where`, the key and the sample; `in_setup` names the block whose rollouts keep them."""
    values = data[key] if key in data else rollout_values
    if values is None:
        raise ValueError(f"{where}: the teacher has context={key!r} and neither this batch (it has "
                         f"{sorted(map(str, data))}) nor a rollout seen by {in_setup} holds the field: run "
                         f"distillation_train inside the {in_setup} block (its rollouts read each sample's field "
                         f"{key!r} or extra_env_info[{key!r}])")
    if isinstance(values, (str, bytes, torch.Tensor)) or not hasattr(values, "__len__"):
        raise TypeError(f"{where}: data[{key!r}] must hold one context per sample (a list), got "
                        f"{type(values).__name__}")
    if len(values) != len(batch):
        raise ValueError(f"{where}: data[{key!r}] holds {len(values)} contexts for a batch of {len(batch)} "
                         "samples: give one per sample, in the batch's order")
    contexts = field_contexts(list(values), key, where, tokenizer, vocab)
    try:
        return with_context(batch, contexts, vocab_size=vocab)
    except (TypeError, ValueError) as error:
        raise type(error)(f"{where}: context {key!r}: {error}") from None
