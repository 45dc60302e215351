"""Which target gets which wrapper, per framework, and the default registry built from them.

Each framework module declares its records and owns their wrappers (named as "module:function"
strings, resolved when the target module is imported). Importing this package imports nothing
heavy: the registry is built on first use. `apply`, `revert` and `applied` here are the
package's public ones.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from megatron_rl_patches.patching.records import Patch, PatchStatus
    from megatron_rl_patches.patching.registry import Registry

_default: Registry | None = None


def all_patches() -> list[Patch]:
    from megatron_rl_patches.integrations import megatron_core, megatron_lm, slime, verl

    return [*megatron_core.PATCHES, *megatron_lm.PATCHES, *slime.PATCHES, *megatron_core.OUTPUT_PROCESSOR_PATCHES,
            *verl.PATCHES]


def default_registry() -> Registry:
    """The process-wide registry of every patch this package knows (built once)."""
    global _default
    if _default is None:
        from megatron_rl_patches.patching.registry import Registry

        _default = Registry(all_patches)
    return _default


def apply(only: Any = None, exclude: Any = None, strict: bool | None = None, allow_untested: bool | None = None,
          *, environ: Any = None) -> list[PatchStatus]:
    """Apply the selected patches (see :meth:`Registry.apply`): idempotent, additive. In a Ray
    driver, ray.init() then warns when its runtime_env would not carry the patches to the actors."""
    statuses = default_registry().apply(only, exclude, strict, allow_untested, environ=environ)
    from megatron_rl_patches.integrations import ray

    ray.arm()
    return statuses


def revert(only: Any = None) -> list[PatchStatus]:
    """Remove the patches (all, or those named), restoring the originals exactly. Idempotent."""
    statuses = default_registry().revert(only)
    if only is None:
        from megatron_rl_patches.integrations import ray

        ray.disarm()
    return statuses


def applied() -> list[PatchStatus]:
    """One status per (patch, target): applied / pending / skipped / failed, with a reason."""
    return default_registry().applied()

