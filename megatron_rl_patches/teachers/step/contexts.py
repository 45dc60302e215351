"""Each teacher's batch of one step (`teacher_batches`): the student's `TeacherBatch` for a teacher
without a context, `with_context(batch, its contexts)` for one with a key (the step's: `privileged`). The loop passes
the contexts with the batch, in either form of its own data:

- keyed: `{KEY: [context of sample 0, context of sample 1, ...]}` (verl's non-tensor batch, a
  NeMo-RL batch field);
- per sample: `[{KEY: context, ...}, ...]`, one mapping per sample (slime's `train_metadata`).

A context is a 1-D integer id tensor or a list of ints in the teacher's tokenizer (the student's,
checked against the host's vocabulary; a served head's, against the head's); text is tokenized
first (`teachers.context_ids`). A teacher of another tokenizer is sent its own encodings
(`cross_batch` of the `TeacherSample`s): its context replaces the prompt of each, as
`cross_with_context` does. A missing key or sample is named with the teacher asking for it."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from megatron_rl_patches.teachers.batch import TeacherBatch
from megatron_rl_patches.teachers.context.teacher_context import id_tensor, one_per_sample, with_context

WHERE = "TeacherStep.send(contexts=...)"


def teacher_batches(teachers: Sequence[Any], keys: Sequence[str | None], batch: TeacherBatch, contexts: object,
                    vocab_size: int | None) -> list[TeacherBatch]:
    """Per teacher the batch it scores (`keys`: each one's context key, the step's; teachers with
    one key share one batch)."""
    if contexts is not None and not isinstance(contexts, Mapping) and \
            (isinstance(contexts, (str, bytes, torch.Tensor)) or not isinstance(contexts, Sequence)):
        raise TypeError(f"{WHERE} takes {{KEY: [one context per sample]}} or one mapping {{KEY: context}} per sample, "
                        f"got {type(contexts).__name__}")
    built: dict[str | None, TeacherBatch] = {None: batch}
    for i, key in enumerate(keys):
        if key in built or key is None:  # None: the student's batch, built above
            continue
        ids = [as_ids(value, sample, key) for sample, value in enumerate(per_sample(contexts, key, len(batch), i))]
        head = getattr(teachers[i], "head", None)  # a served head's vocabulary is the teacher's own
        try:
            built[key] = with_context(batch, ids, vocab_size=vocab_size if head is None else head.vocab_size)
        except (TypeError, ValueError) as error:
            raise type(error)(f"{WHERE}: teacher {i}'s context {key!r}: {error}") from None
    return [built[key] for key in keys]


def per_sample(contexts: object, key: str, samples: int, teacher: int) -> list[Any]:
    """Every sample's context under `key`, in the batch's order (a missing one named)."""
    asking = f"teacher {teacher} has context={key!r}"
    if contexts is None:
        raise ValueError(f"{WHERE}: {asking} but no contexts were passed: send(batch, contexts={{{key!r}: [one per "
                         "sample]}})")
    if isinstance(contexts, Mapping):
        if key not in contexts:
            raise ValueError(f"{WHERE}: {asking} but the contexts hold no key {key!r} (they hold "
                             f"{sorted(map(str, contexts))}): pass every sample's context under it")
        return one_per_sample(contexts[key], samples, f"{WHERE}: contexts[{key!r}]")
    assert isinstance(contexts, Sequence)
    if len(contexts) != samples:
        raise ValueError(f"{WHERE}: {len(contexts)} per-sample mappings for a batch of {samples} samples: give one "
                         "per sample, in the batch's order")
    values = []
    for sample, data in enumerate(contexts):
        if not isinstance(data, Mapping):
            raise TypeError(f"{WHERE}: sample {sample}'s data must be a mapping {{KEY: context}}, got "
                            f"{type(data).__name__}")
        if key not in data:
            raise ValueError(f"{WHERE}: sample {sample} has no context under {key!r} ({asking}; the sample holds "
                             f"{sorted(map(str, data))})")
        values.append(data[key])
    return values


def as_ids(value: object, sample: int, key: str) -> Any:
    """A list of ints as an int64 tensor; text refused (tokenize it first); anything else left to
    `with_context`'s checks."""
    if value is None:
        raise ValueError(f"{WHERE}: sample {sample} has no context under {key!r} (None)")
    if isinstance(value, str):
        raise TypeError(f"{WHERE}: sample {sample}'s context under {key!r} is text: tokenize it with the teacher's "
                        "tokenizer first (teachers.context_ids(texts, tokenizer))")
    if isinstance(value, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return id_tensor(value, f"{WHERE}: sample {sample}'s context under {key!r}")
    return value
