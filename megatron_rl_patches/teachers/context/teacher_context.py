"""A teacher that sees what the student cannot (a privileged context: a verified solution, a hint,
a system prompt): it scores `context_i + response_i`, the student's own response ids after a
context of its own per sample, its response rows lined up one to one with the student's.

- `with_context(batch, contexts)`: the teacher's `TeacherBatch` from the student's;
- `context_ids(texts, tokenizer)`: text contexts as the teacher's ids (no special tokens added
  unless asked);
- `placed_before(batch, privileged, marker)`: chat templates: each sample's student prompt with the
  privileged ids put before a named token sequence of it (e.g. the assistant turn's marker), as
  contexts for `with_context`; the privileged ids alone are the other placement (the whole
  teacher prompt)."""
from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

import torch

from megatron_rl_patches.teachers.batch import TeacherBatch
from megatron_rl_patches.teachers.finite import int64_id, utf8_text

WHERE = "with_context"
OCCURRENCES = ("only", "first", "last")


def with_context(batch: TeacherBatch, contexts: Sequence[torch.Tensor], *, vocab_size: int | None = None,
                 max_length: int | None = None) -> TeacherBatch:
    """The teacher's batch: `sequences[i] = contexts[i]` then the student's response ids of sample i,
    `response_starts[i] = len(contexts[i])`. `vocab_size`: the teacher's vocabulary (ids at or past
    it refused); `max_length`: the teacher's length budget per sample (e.g. the server's
    max_model_len), a longer sample refused before anything is sent. The caller's tensors are
    read only. The teacher's sequence keeps the response's dtype and device (each context cast to
    them in a new tensor): an id that dtype cannot hold is refused before anything is cast."""
    if not isinstance(batch, TeacherBatch):
        raise TypeError(f"{WHERE}(batch=...) takes the student's TeacherBatch, got {type(batch).__name__}")
    check_budget("vocab_size", vocab_size, "the teacher's vocabulary size")
    check_budget("max_length", max_length, "the teacher's length budget per sample, e.g. the server's max_model_len")
    contexts = context_list(contexts, len(batch))
    sequences, starts = [], []
    for sample, context in enumerate(contexts):
        response = batch.sequences[sample][batch.response_starts[sample]:]
        check_context(sample, context, vocab_size, response.dtype)
        if max_length is not None and len(context) + len(response) > max_length:
            raise ValueError(f"{WHERE}: sample {sample}'s context ({len(context)} ids) and response ({len(response)} "
                             f"ids) make {len(context) + len(response)} ids, past max_length={max_length} (the "
                             f"teacher's length budget): shorten the context, or serve the teacher with a longer "
                             f"max_model_len")
        sequences.append(torch.cat([context.to(device=response.device, dtype=response.dtype), response]))
        starts.append(len(context))
    return TeacherBatch(sequences, starts)


def checked_contexts(batch: TeacherBatch, contexts: Sequence[torch.Tensor], *,
                     vocab_size: int | None = None) -> list[torch.Tensor]:
    """`contexts` checked as `with_context(batch, contexts, vocab_size=...)` checks them (the same
    refusals, in the same words), nothing built: for a loop that checks the contexts where its
    ranks can agree them and hands them on to the step, which builds the teacher's batch once."""
    if not isinstance(batch, TeacherBatch):
        raise TypeError(f"{WHERE}(batch=...) takes the student's TeacherBatch, got {type(batch).__name__}")
    check_budget("vocab_size", vocab_size, "the teacher's vocabulary size")
    contexts = context_list(contexts, len(batch))
    for sample, context in enumerate(contexts):
        check_context(sample, context, vocab_size, batch.sequences[sample].dtype)
    return contexts


def check_budget(name: str, value: object, what: str) -> None:
    """An optional positive int keyword of `with_context`."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1):
        raise ValueError(f"{WHERE}({name}={value!r}): pass {what}, a positive int, or None")


def context_list(contexts: object, samples: int) -> list[Any]:
    """`contexts` as a list of one entry per sample (a count other than the batch's refused)."""
    return one_per_sample(contexts, samples, f"{WHERE}(contexts=...)", "a list of 1-D id tensors, one per sample",
                          " (text contexts: tokenize them first with context_ids)")


def one_per_sample(values: object, samples: int, named: str, form: str = "a list of one context per sample",
                   hint: str = "") -> list[Any]:
    """`values` as a list of one context per sample: a sequence (no tensor, no text) of `samples`
    entries; the refusals say `named` (the argument), the `form` it takes and a `hint`."""
    if isinstance(values, (torch.Tensor, str, bytes)) or not isinstance(values, Sequence):
        raise TypeError(f"{named} must be {form}, got {type(values).__name__}{hint}")
    if len(values) != samples:
        raise ValueError(f"{named} holds {len(values)} contexts for a batch of {samples} samples: give one per "
                         "sample, in the batch's order")
    return list(values)


def check_context(sample: int, context: object, vocab_size: int | None, dtype: torch.dtype | None = None,
                  names: tuple[str, str] = ("contexts", "response")) -> None:
    """Sample `sample`'s context: a non-empty 1-D integer id tensor of ids in [0, vocab_size),
    each one `dtype` holds (the dtype it is cast to: the sequence's it joins; `names`: how the
    messages name the contexts and that sequence)."""
    if context is None:
        raise ValueError(f"{WHERE}(contexts=...): sample {sample} has no context (None): give every sample its "
                         "context, or score that teacher without one")
    if not isinstance(context, torch.Tensor) or context.dim() != 1 or context.dtype.is_floating_point \
            or context.is_complex() or context.dtype == torch.bool:
        shown = f"a tensor of shape {tuple(context.shape)} and dtype {context.dtype}" \
            if isinstance(context, torch.Tensor) else type(context).__name__
        raise TypeError(f"{WHERE}(contexts=...): contexts[{sample}] must be a 1-D integer id tensor, got {shown} "
                        "(text: tokenize it with context_ids)")
    if not context.numel():
        raise ValueError(f"{WHERE}(contexts=...): contexts[{sample}] is empty: the first response token needs a "
                         "context before it; give that sample its context")
    low, high = int(context.min()), int(context.max())
    if low < 0:
        raise ValueError(f"{WHERE}(contexts=...): contexts[{sample}] holds a negative id ({low}): ids are the "
                         "teacher's vocabulary indices")
    if vocab_size is not None and high >= vocab_size:
        raise ValueError(f"{WHERE}(contexts=...): contexts[{sample}] holds id {high}, past the teacher's vocabulary "
                         f"of {vocab_size}: tokenize the context with the teacher's tokenizer")
    if dtype is not None and high > torch.iinfo(dtype).max:  # checked before the cast, which would wrap it
        given, joined = names
        raise ValueError(f"{given}[{sample}] holds id {high}, which the {joined}'s dtype {dtype} cannot hold (ids up "
                         f"to {torch.iinfo(dtype).max}): the teacher's sequence keeps the {joined}'s dtype; give the "
                         "student's sequences as int64 (or a dtype holding the teacher's vocabulary)")


def id_tensor(values: Sequence[Any], where: str) -> torch.Tensor:
    """Ids given as ints (a list or tuple) as an int64 tensor; one outside int64 refused naming
    `where` (torch's bare "Overflow when unpacking long long" otherwise)."""
    try:
        return torch.tensor(list(values), dtype=torch.long)
    except (RuntimeError, OverflowError, ValueError, TypeError):
        for value in values:
            int64_id(int(value), where)
        raise


def context_ids(texts: Sequence[str], tokenizer: Any, *, add_special_tokens: bool = False,
                samples: Sequence[int | str] | None = None) -> list[torch.Tensor]:
    """Text contexts, one per sample, as the teacher's ids (int64): `tokenizer` a
    `tokenizers.Tokenizer`, a tokenizer.json path or a checkpoint directory holding one. No special
    tokens are added unless `add_special_tokens=True` (a chat template's own markers are text).
    `samples`: the sample each text is (where the texts are some samples' only, the others' given
    as ids), for the messages: its index, or words naming it (`sample_name`); None: texts[i] is
    sample i."""
    # lazy: optional dependency tokenizers (text contexts only)
    from megatron_rl_patches.cross_tokenizer.loading import load_tokenizer

    if isinstance(texts, (str, bytes)) or not isinstance(texts, Sequence):
        raise TypeError(f"context_ids(texts=...) takes a list of strings, one per sample, got {type(texts).__name__}")
    if not isinstance(add_special_tokens, bool):
        raise TypeError(f"context_ids(add_special_tokens=...) must be a bool (whether the tokenizer's template adds "
                        f"its special tokens), got {type(add_special_tokens).__name__}")
    named = text_names(len(texts), samples)
    for i, text in enumerate(texts):
        if text is None:
            raise ValueError(f"context_ids(texts=...): {sample_name(i if samples is None else samples[i])} has no "
                             "context (None): give every sample its context text")
        if not isinstance(text, str):
            raise TypeError(f"context_ids(texts=...): {named[i]} must be a str, got {type(text).__name__}")
        if not text:
            raise ValueError(f"context_ids(texts=...): {named[i]} is empty: give that sample its context text")
        utf8_text(text, f"context_ids(texts=...): {named[i]}")  # the tokenizers library's bare TypeError otherwise
    read = load_tokenizer(tokenizer, "context_ids(tokenizer=...)")
    encoded = read.encode_batch(list(texts), add_special_tokens=add_special_tokens)
    ids = [torch.tensor(one.ids, dtype=torch.long) for one in encoded]
    for i, one in enumerate(ids):
        if not one.numel():
            raise ValueError(f"context_ids(texts=...): {named[i]} tokenizes to no ids: give that sample a context the "
                             "teacher's tokenizer reads")
    return ids


def text_names(count: int, samples: Sequence[int | str] | None) -> list[str]:
    """How `context_ids`' messages name each of `count` texts: texts[i], or sample n's text."""
    if samples is None:
        return [f"texts[{i}]" for i in range(count)]
    if isinstance(samples, (str, bytes)) or not isinstance(samples, Sequence) or len(samples) != count:
        raise ValueError(f"context_ids(samples=...) must name the sample of each of the {count} texts (a list of "
                         f"{count} ints), or be None")
    return [f"{sample_name(n)}'s text" for n in samples]


def sample_name(sample: int | str) -> str:
    """How a message names a sample: `sample N` for its index, else the caller's words (e.g. verl's
    "the sample with a prompt of 3 ids (of 7)")."""
    return sample if isinstance(sample, str) else f"sample {sample}"


def placed_before(batch: TeacherBatch, privileged: Sequence[torch.Tensor], marker: Sequence[int] | torch.Tensor, *,
                  occurrence: str = "only") -> list[torch.Tensor]:
    """Per sample the student's prompt (its ids before the response) with `privileged[i]` put just
    before `marker` (a token sequence of the prompt, e.g. the assistant turn's marker ids): the
    contexts for `with_context`. `occurrence`: "only" (a prompt holding the marker more than once
    refused), "first" or "last" (multi-turn prompts). Only the prompt is searched and spliced: the
    response ids are the student's, never re-tokenized."""
    if not isinstance(batch, TeacherBatch):
        raise TypeError(f"placed_before(batch=...) takes the student's TeacherBatch, got {type(batch).__name__}")
    if occurrence not in OCCURRENCES:
        raise ValueError(f"placed_before(occurrence={occurrence!r}): pass one of {list(OCCURRENCES)}")
    wanted = marker_ids(marker)
    privileged = context_list(privileged, len(batch))
    contexts = []
    for sample, ids in enumerate(privileged):
        prompt = batch.sequences[sample][:batch.response_starts[sample]]
        check_context(sample, ids, None, prompt.dtype, ("privileged", "prompt"))
        at = marker_at(sample, prompt, wanted, occurrence)
        contexts.append(torch.cat([prompt[:at], ids.to(device=prompt.device, dtype=prompt.dtype), prompt[at:]]))
    return contexts


def marker_ids(marker: object) -> torch.Tensor:
    """`placed_before`'s marker as a non-empty 1-D int64 tensor."""
    if isinstance(marker, torch.Tensor):
        if marker.dim() != 1 or marker.dtype.is_floating_point or marker.dtype == torch.bool:
            raise TypeError(f"placed_before(marker=...) must be a 1-D integer id tensor or a list of ints, got a "
                            f"tensor of shape {tuple(marker.shape)} and dtype {marker.dtype}")
        ids = marker.to(torch.long).cpu()
    elif isinstance(marker, Sequence) and not isinstance(marker, (str, bytes)) \
            and all(isinstance(i, numbers.Integral) and not isinstance(i, bool) for i in marker):
        ids = id_tensor(marker, "placed_before(marker=...)")
    else:
        raise TypeError(f"placed_before(marker=...) must be the marker's ids (a 1-D integer tensor or a list of ints), "
                        f"got {type(marker).__name__} (text: tokenize it with context_ids([text], tokenizer)[0])")
    if not ids.numel():
        raise ValueError("placed_before(marker=...) is empty: give the ids of the prompt's marker (e.g. the assistant "
                         "turn's)")
    return ids


def marker_at(sample: int, prompt: torch.Tensor, marker: torch.Tensor, occurrence: str) -> int:
    """Where `marker` starts in sample `sample`'s prompt (the occurrence asked)."""
    width = len(marker)
    found = []
    if len(prompt) >= width:
        windows = prompt.cpu().to(torch.long).unfold(0, width, 1)
        found = (windows == marker).all(dim=1).nonzero().flatten().tolist()
    if not found:
        raise ValueError(f"placed_before: sample {sample}'s prompt ({len(prompt)} ids) does not hold the marker "
                         f"{marker.tolist()}: name a token sequence the student's prompt holds, or use the privileged "
                         "ids as the whole teacher prompt (with_context(batch, privileged))")
    if occurrence == "only" and len(found) > 1:
        raise ValueError(f"placed_before: sample {sample}'s prompt holds the marker {marker.tolist()} {len(found)} "
                         f"times (at {found}): name a longer marker, or pass occurrence='first' / 'last'")
    return found[-1] if occurrence == "last" else found[0]
