"""Which target gets which wrapper, per framework. Declarations only: importing these
modules imports nothing heavy; the wrappers are named as "module:function" strings and are
resolved when their target module is imported."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron_rl_patches.patching.registry import Patch


def all_patches() -> list[Patch]:
    from megatron_rl_patches.integrations import megatron_core, megatron_lm, slime

    return [*megatron_core.PATCHES, *megatron_lm.PATCHES, *slime.PATCHES]
