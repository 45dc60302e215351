"""The model kinds the test kit builds, and the error for a kind the installed megatron-core
cannot build. A leaf: the kit's builders import it, it imports nothing of theirs."""
from __future__ import annotations

MODEL_KINDS = ("gpt", "hybrid")


class ModelKindUnavailable(ImportError):
    """The installed megatron-core cannot build this model kind (tests skip with its message)."""
