"""Environment variables set for a block and put back after it."""
from __future__ import annotations

import contextlib
import os

from megatron_rl_patches.patching.shadow import replaced


def environment(values: dict[str, str]) -> contextlib.AbstractContextManager[None]:
    """`values` in os.environ for the block (a process started inside it inherits them); each name's
    earlier value, or its absence, restored after."""
    return replaced(os.environ, values)
