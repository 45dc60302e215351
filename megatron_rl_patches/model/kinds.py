"""What a module of a megatron-core model is, read from what it holds (duck-typed, so a test kit's
stand-in or another release's class counts as well): the language model (GPTModel, HybridModel and
their kin) and an attention layer. Imports nothing: any room may ask."""
from __future__ import annotations

from typing import Any

LANGUAGE_MODEL_FIELDS = ("decoder", "pre_process", "post_process", "vocab_size")


def is_language_model(module: Any) -> bool:
    """GPTModel / HybridModel (and their kin): an embedding stage flag, a decoder, a vocabulary."""
    return all(hasattr(module, name) for name in LANGUAGE_MODEL_FIELDS)


def is_attention(module: Any) -> bool:
    """An attention layer: megatron-core's `Attention` (self-attention, the gated kind too)."""
    return hasattr(module, "core_attention") and hasattr(module, "linear_proj")


def qualified_name(cls: type) -> str:
    """A class's module and qualified name ("package.module.Class"), as refusals name a layer."""
    return f"{cls.__module__}.{cls.__qualname__}"
