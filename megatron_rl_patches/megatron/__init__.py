"""The output processors' earlier home: `megatron_rl_patches.megatron.<name>` and its modules
`processors` and `distill` are `megatron_rl_patches.processors`' (no warning: users type these
paths). New code imports `megatron_rl_patches.processors`."""
from __future__ import annotations

from typing import Any

import megatron_rl_patches.processors as _processors
from megatron_rl_patches import _aliases

__all__ = _processors.__all__


def __getattr__(name: str) -> Any:
    return getattr(_processors, name)  # resolved lazily there (not a global named `processors`: the module is)


_aliases.install(__name__, {"processors": "megatron_rl_patches.processors.heads",
                            "distill": "megatron_rl_patches.processors.distill"},
                 silent=("processors", "distill"))
