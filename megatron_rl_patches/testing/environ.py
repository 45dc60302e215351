"""Environment variables set for a block and put back after it."""
from __future__ import annotations

import contextlib

from megatron_rl_patches.patching.shadow import replaced
from megatron_rl_patches.settings import process_environment


def environment(values: dict[str, str]) -> contextlib.AbstractContextManager[None]:
    """`values` in this process's environment for the block (a process started inside it inherits
    them); each name's earlier value, or its absence, restored after."""
    return replaced(process_environment(), values)
