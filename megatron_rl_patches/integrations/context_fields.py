"""A privileged context read from a framework's per-sample field (verl's non-tensor batch, a
NeMo-RL batch field): `field_contexts(values, key, ...)` makes each sample's value the teacher's
ids. A value is ids (a 1-D integer tensor, array or list) or text (tokenized by the teacher's
tokenizer, which must then be named); numpy 0-d objects (verl's non-tensor rows) are unwrapped.
Every refusal names the sample, the key and what to do."""
from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

import torch

from megatron_rl_patches.teachers.context import context_ids, id_tensor


def unwrapped(value: Any) -> Any:
    """A numpy 0-d array or scalar as its Python object; a numpy array as a list."""
    if type(value).__module__ == "numpy":
        return value.item() if getattr(value, "ndim", 0) == 0 else value.tolist()
    return value


def field_contexts(values: Sequence[Any], key: str, where: str, tokenizer: Any = None,
                   vocab_size: int | None = None) -> list[torch.Tensor]:
    """Each sample's context under `key` (`values[i]` sample i's) as int64 ids. Text needs
    `tokenizer` (the teacher's: a tokenizers.Tokenizer, a tokenizer.json or a directory holding
    one); ids at or past `vocab_size` are refused (with_context checks them again)."""
    ids: list[Any] = [None] * len(values)
    texts: dict[int, str] = {}
    for sample, raw in enumerate(values):
        value = unwrapped(raw)
        if value is None:
            raise ValueError(f"{where}: sample {sample} has no context under {key!r} (None): give every sample its "
                             "privileged context, or drop context= from the teacher")
        if isinstance(value, str):
            texts[sample] = value
        elif isinstance(value, torch.Tensor):
            ids[sample] = value.detach().cpu()
        elif isinstance(value, (list, tuple)) and all(isinstance(v, numbers.Integral) and not isinstance(v, bool)
                                                      for v in value):
            ids[sample] = id_tensor([int(v) for v in value], f"{where}: sample {sample}'s context under {key!r}")
        else:
            raise TypeError(f"{where}: sample {sample}'s context under {key!r} must be text or the teacher's ids (a "
                            f"1-D integer list, array or tensor), got {type(value).__name__}")
    if texts:
        if tokenizer is None:
            first = min(texts)
            raise ValueError(f"{where}: sample {first}'s context under {key!r} is text and no teacher tokenizer is "
                             "named to tokenize it: name the teacher's tokenizer, or store the context as ids")
        for sample, one in zip(texts, context_ids(list(texts.values()), tokenizer, samples=list(texts))):
            ids[sample] = one
    for sample, one in enumerate(ids):
        if one.dim() != 1 or one.dtype.is_floating_point or one.dtype == torch.bool:
            raise TypeError(f"{where}: sample {sample}'s context under {key!r} must be 1-D integer ids, got shape "
                            f"{tuple(one.shape)} and dtype {one.dtype}")
        if vocab_size is not None and one.numel() and int(one.max()) >= vocab_size:
            raise ValueError(f"{where}: sample {sample}'s context under {key!r} holds id {int(one.max())}, past the "
                             f"teacher's vocabulary of {vocab_size}: tokenize it with the teacher's tokenizer")
        ids[sample] = one.to(torch.long)
    return ids


def tokenizer_vocab(tokenizer: Any) -> int | None:
    """The vocabulary size of a named teacher tokenizer (None: none named)."""
    if tokenizer is None:
        return None
    from megatron_rl_patches.cross_tokenizer.loading import load_tokenizer  # lazy: optional dependency tokenizers

    return int(load_tokenizer(tokenizer, "the teacher's tokenizer").get_vocab_size(with_added_tokens=True))
