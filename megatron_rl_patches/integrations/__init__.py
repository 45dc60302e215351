"""Which target gets which wrapper, per framework, and the default registry built from them.

Each framework module declares its records (module-level tuples, named in RECORDS) and owns
their wrappers (named as "module:function" strings, resolved when the target module is
imported). Importing this package imports nothing heavy: the registry is built on first use.
`apply`, `revert` and `applied` here are the package's public ones.
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from megatron_rl_patches.patching.records import Patch, PatchStatuses
    from megatron_rl_patches.patching.registry import Registry

_default: Registry | None = None
_building = threading.Lock()


# Every integration's records, one row per record list: "module:attribute" below this package,
# the way entry points name them. A new framework is one new module and one row here. Rows are in
# listing order: a patch name is listed where it first appears (the newest last).
RECORDS = (
    "megatron_core:PATCHES",
    "megatron_lm:PATCHES",
    "slime:PATCHES",
    "megatron_core:OUTPUT_PROCESSOR_PATCHES",
    "megatron_core:WINDOW_PATCHES",
    "verl:PATCHES",
    "slime_fused:PATCHES",
    "slime_opd:PATCHES",
    "verl_rows:PATCHES",
    "megatron_core:HEAD_PATCHES",
)


def all_patches() -> list[Patch]:
    """The records of every row of RECORDS, in order (imports the integration modules, which
    import nothing heavy)."""
    import pkgutil

    return [patch for row in RECORDS for patch in pkgutil.resolve_name(f"{__name__}.{row}")]


def default_registry() -> Registry:
    """The process-wide registry of every patch this package knows (built once)."""
    global _default
    with _building:  # threads racing the first apply() must all get the same registry
        if _default is None:
            from megatron_rl_patches.patching.registry import Registry

            _default = Registry(all_patches)
        return _default


def apply(only: Any = None, exclude: Any = None, strict: bool | None = None, allow_untested: bool | None = None,
          *, environ: Any = None) -> PatchStatuses:
    """Apply the selected patches (see :meth:`Registry.apply`): idempotent, additive. In a Ray
    driver, ray.init() then warns when its runtime_env would not carry the patches to the actors."""
    statuses = default_registry().apply(only, exclude, strict, allow_untested, environ=environ)
    from megatron_rl_patches.integrations import ray

    ray.arm()
    return statuses


def revert(only: Any = None) -> PatchStatuses:
    """Remove the patches (all, or those named), restoring the originals exactly. Idempotent."""
    statuses = default_registry().revert(only)
    if only is None:
        from megatron_rl_patches.integrations import ray

        ray.disarm()
    return statuses


def applied() -> PatchStatuses:
    """One status per (patch, target): applied / pending / skipped / failed, with a reason; printed,
    one line per patch. Warns once when MEGATRON_RL_PATCHES is set but start-up patching did not run."""
    from megatron_rl_patches.patching.startup import hook

    hook.warn_if_not_run()
    return default_registry().applied()

