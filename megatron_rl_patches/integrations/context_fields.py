"""The one adapter from a framework's per-sample field to a privileged teacher's batch (verl's
non-tensor batch, a NeMo-RL batch field, slime's train_metadata): each framework reads its field's
values, one per sample, and hands them here.

- `field_contexts(values, key, ...)`: each sample's value as the teacher's ids. A value is ids (a
  1-D integer tensor, array or list) or text (tokenized by the teacher's tokenizer, which must
  then be named); numpy 0-d objects (verl's non-tensor rows) are unwrapped.
- `privileged_batch(student, values, key, ...)`: those contexts before the student's response ids
  (`teachers.with_context`), the teacher's batch.

Every refusal names the sample, the key and what to do."""
from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

import torch

from megatron_rl_patches.teachers.batch import TeacherBatch
from megatron_rl_patches.teachers.context.teacher_context import context_ids, id_tensor, sample_name, with_context


def unwrapped(value: Any) -> Any:
    """A numpy 0-d array or scalar as its Python object; a numpy array as a list."""
    if type(value).__module__ == "numpy":
        return value.item() if getattr(value, "ndim", 0) == 0 else value.tolist()
    return value


def field_contexts(values: Sequence[Any], key: str, where: str, tokenizer: Any = None,
                   vocab_size: int | None = None, *, samples: Sequence[int | str] | None = None,
                   field: str | None = None, ids: str = "the teacher's ids") -> list[torch.Tensor]:
    """Each sample's context under `key` (`values[i]` sample i's) as int64 ids. Text needs
    `tokenizer` (the teacher's: a tokenizers.Tokenizer, a tokenizer.json or a directory holding
    one); ids at or past `vocab_size` are refused (with_context checks them again). How messages
    name things: `samples` each value's sample (its index in the loop's data, or words; None:
    its place in `values`), `field` the value (default "context under KEY", e.g. slime's
    "train_metadata[KEY]"), `ids` the ids a value may be instead of text."""
    names = [sample_name(n) for n in (range(len(values)) if samples is None else samples)]
    field = f"context under {key!r}" if field is None else field
    found: list[Any] = [None] * len(values)
    texts: dict[int, str] = {}
    for sample, raw in enumerate(values):
        value = unwrapped(raw)
        if value is None:
            raise ValueError(f"{where}: {names[sample]} has no {field} (None): give every sample its privileged "
                             "context, or drop context= from the teacher")
        if isinstance(value, str):
            texts[sample] = value
        elif isinstance(value, torch.Tensor):
            found[sample] = value.detach().cpu()
        elif isinstance(value, (list, tuple)) and all(isinstance(v, numbers.Integral) and not isinstance(v, bool)
                                                      for v in value):
            found[sample] = id_tensor([int(v) for v in value], f"{where}: {names[sample]}'s {field}")
        else:
            raise TypeError(f"{where}: {names[sample]}'s {field} must be text or {ids} (a 1-D integer list, array or "
                            f"tensor), got {type(value).__name__}")
    if texts:
        if tokenizer is None:
            first = min(texts)
            raise ValueError(f"{where}: {names[first]}'s {field} is text and no teacher tokenizer is named to "
                             "tokenize it: name the teacher's tokenizer, or store the context as ids")
        told = [samples[i] if samples is not None else i for i in texts]
        try:
            read = context_ids(list(texts.values()), tokenizer, samples=told)
        except (TypeError, ValueError) as error:  # a text's refusal, with the field (its key) it came from
            raise type(error)(f"{where}: {field}: {error}") from None
        for sample, one in zip(texts, read):
            found[sample] = one
    for sample, one in enumerate(found):
        if one.dim() != 1 or one.dtype.is_floating_point or one.dtype == torch.bool:
            raise TypeError(f"{where}: {names[sample]}'s {field} must be 1-D integer ids, got shape "
                            f"{tuple(one.shape)} and dtype {one.dtype}")
        if vocab_size is not None and one.numel() and int(one.max()) >= vocab_size:
            raise ValueError(f"{where}: {names[sample]}'s {field} holds id {int(one.max())}, past the teacher's "
                             f"vocabulary of {vocab_size}: tokenize it with the teacher's tokenizer")
        found[sample] = one.to(torch.long)
    return found


def privileged_batch(student: TeacherBatch, values: Sequence[Any], key: str, where: str, tokenizer: Any = None,
                     vocab_size: int | None = None, *, samples: Sequence[int | str] | None = None) -> TeacherBatch:
    """The teacher's batch: each sample's context (`values`, one per sample of `student`, read by
    `field_contexts`) then its response ids (`with_context`, whose refusals name `where` and `key`)."""
    if isinstance(values, (str, bytes, torch.Tensor)) or not hasattr(values, "__len__"):
        raise TypeError(f"{where}: data[{key!r}] must hold one context per sample (a list), got "
                        f"{type(values).__name__}")
    if len(values) != len(student):
        raise ValueError(f"{where}: data[{key!r}] holds {len(values)} contexts for a batch of {len(student)} "
                         "samples: give one per sample, in the batch's order")
    contexts = field_contexts(list(values), key, where, tokenizer, vocab_size, samples=samples)
    try:
        return with_context(student, contexts, vocab_size=vocab_size)
    except (TypeError, ValueError) as error:
        raise type(error)(f"{where}: context {key!r}: {error}") from None


def tokenizer_vocab(tokenizer: Any) -> int | None:
    """The vocabulary size of a named teacher tokenizer, added tokens included (None: none named)."""
    if tokenizer is None:
        return None
    from megatron_rl_patches.cross_tokenizer.loading import load_tokenizer  # lazy: optional dependency tokenizers

    return int(load_tokenizer(tokenizer, "the teacher's tokenizer").get_vocab_size(with_added_tokens=True))
