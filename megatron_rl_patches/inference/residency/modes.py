"""The residency modes a frozen build may name, under the inference path users import
(`inference.RESIDENCY_MODES`); defined once in megatron_rl_patches/settings.py."""
from __future__ import annotations

from megatron_rl_patches.settings import RESIDENCY_MODES

__all__ = ["RESIDENCY_MODES"]
