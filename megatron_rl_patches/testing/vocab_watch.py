"""Proof that no [T, V] logits exist: a context manager that watches every tensor torch ops
allocate while it is active and keeps the largest one whose last dimension is the vocabulary.

    with VocabWideTensors(vocab=V) as watch:
        loss = step(...)
        loss.backward()
    assert watch.largest_shape[0] < T  # only logits tiles, never the [T, V] logits
"""
from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["VocabWideTensors"]


class VocabWideTensors:
    """Watches the tensors ops allocate (a torch dispatch mode; views and in-place results are not
    allocations) for the largest one whose last dimension is the vocabulary. The logits route
    allocates [b, s, V] logits per forward; the fused route only logits tiles."""

    def __init__(self, vocab: int):
        self.vocab = vocab
        self.largest_bytes = 0
        self.largest_shape: tuple[int, ...] = ()

    def record(self, tensor: torch.Tensor) -> None:
        if tensor.dim() < 2 or tensor.shape[-1] != self.vocab:
            return
        size = tensor.numel() * tensor.element_size()
        if size > self.largest_bytes:
            self.largest_bytes, self.largest_shape = size, tuple(tensor.shape)

    def __enter__(self) -> VocabWideTensors:
        watch = self
        allocates: dict[Any, bool] = {}  # per op: none of its results aliases an input (a view, in place)

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                fresh = allocates.get(func)
                if fresh is None:  # reading the schema's returns costs more than most tiny ops
                    fresh = allocates[func] = not any(ret.alias_info is not None for ret in func._schema.returns)
                if fresh:
                    if isinstance(out, torch.Tensor):
                        watch.record(out)
                    else:
                        for value in tree_flatten(out)[0]:
                            if isinstance(value, torch.Tensor):
                                watch.record(value)
                return out

        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._mode.__exit__(*exc)

    def as_dict(self) -> dict[str, Any]:
        return {"largest_bytes": self.largest_bytes, "largest_shape": list(self.largest_shape)}
