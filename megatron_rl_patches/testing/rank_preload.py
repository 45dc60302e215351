"""Imported once by the forkserver of `multirank.use_forkserver()`: torch and megatron-core, which
every rank would import again (4-5 s each), with their import-time warnings unprinted (a spawned
rank would print them to its own caller's output; the server's output is the first world's)."""
from __future__ import annotations

import importlib
import warnings

MODULES = (
    "torch", "torch.distributed", "megatron.core", "megatron.core.parallel_state",
    "megatron.core.tensor_parallel", "megatron.core.models.gpt", "megatron.core.transformer",
)

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    for name in MODULES:
        try:
            importlib.import_module(name)
        except ImportError:  # megatron-core is optional: the ranks import what they need themselves
            pass
