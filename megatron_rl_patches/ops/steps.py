"""Deprecated alias: the shared steps live beside what they serve. `moved` / `moved_stats` in the
statistics core (:mod:`._stats`), `require_good_rows` with the checks (:mod:`._checks`),
`save_tau` / `saved_scale` with the autograd Functions (:mod:`._functions`), `accumulate` with the
torch tiles (:mod:`.kernels.torch_tiles`). Importing this module warns once (DeprecationWarning)."""
from __future__ import annotations

import warnings

from megatron_rl_patches.ops._checks import require_good_rows
from megatron_rl_patches.ops._functions import save_tau, saved_scale
from megatron_rl_patches.ops._stats import moved, moved_stats
from megatron_rl_patches.ops.kernels.torch_tiles import accumulate

__all__ = ["moved", "moved_stats", "accumulate", "save_tau", "saved_scale", "require_good_rows"]

warnings.warn(
    "megatron_rl_patches.ops.steps is deprecated: import moved / moved_stats from megatron_rl_patches.ops._stats, "
    "require_good_rows from ops._checks, save_tau / saved_scale from ops._functions and accumulate from "
    "ops.kernels.torch_tiles",
    DeprecationWarning,
    stacklevel=2,
)
