"""Which target gets which wrapper, per framework, and the default registry built from them.

One package per framework (FRAMEWORKS): its `patches` module declares all its records (PATCHES)
and its other modules own the wrappers (named as "module:function" strings, resolved when the
target module is imported). Importing this package imports nothing heavy: the registry is built
on first use. `apply`, `revert` and `applied` here are the package's public ones.
"""
# lazy imports: import cost: the frameworks and the registry (wrapt) load on first call (test_lazy_import)
from __future__ import annotations

import importlib
import threading
from typing import TYPE_CHECKING, Any

from megatron_rl_patches import _aliases
from megatron_rl_patches.patching import env
from megatron_rl_patches.patching.startup import hook

if TYPE_CHECKING:
    from megatron_rl_patches.patching.records import Patch, PatchStatuses
    from megatron_rl_patches.patching.registry import Registry

_default: Registry | None = None
_building = threading.Lock()


# The framework packages below this one, each with a `patches` module defining PATCHES (and, when
# the framework reads variables of its own, `check_settings(environ)`). A new framework is one new
# package, one row here and its patch names in ORDER.
FRAMEWORKS = ("megatron", "slime", "verl", "nemo_rl")
# The packages below this one that are no framework's: what every framework's door reads (no records).
SHARED_BY_FRAMEWORKS = ("shared_prefix_doors",)
# Patch names in listing order (listings, messages, the order records are applied in): the first
# release's first, the newest last. Records of one name keep their framework's declaration order.
ORDER = (
    "ddp_hooks",
    "train_reentry",
    "inference_roles",
    "slime_logprobs",
    "gpt_output_processor",
    "grad_windows",
    "verl_fused_logprobs",
    "verl_topk_kd",
    "slime_fused",
    "slime_opd",
    "hybrid_output_processor",
    "mtp_output_processor",
    "nemo_rl_fused_logprobs",
    "nemo_rl_topk",
    "nemo_rl_topk_kd",
    "nemo_rl_shared_prefix",
)


def all_patches() -> list[Patch]:
    """Every framework's records, ordered by ORDER (imports the `patches` modules, which import
    nothing heavy). A patch name missing from ORDER is an error, not a silent last place."""
    records = [patch for framework in FRAMEWORKS
               for patch in importlib.import_module(f"{__name__}.{framework}.patches").PATCHES]
    unordered = sorted({patch.name for patch in records} - set(ORDER))
    if unordered:
        raise RuntimeError(f"patch names {unordered} are not in {__name__}.ORDER: add them there")
    return sorted(records, key=lambda patch: ORDER.index(patch.name))


def check_settings(environ: Any = None) -> None:
    """Every framework's own variables, each checked by the `check_settings(environ)` its `patches`
    module declares beside its PATCHES (slime: top-k OPD's MEGATRON_RL_PATCHES_OPD_*), and no
    misspelled variable name of ours: a ValueError naming the variable at fault. `run`, the start-up
    hook and `doctor` call this (patching names it by a string, SETTINGS_CHECK)."""
    env.check_variable_names(variable_names(), environ)
    for framework in FRAMEWORKS:
        check = getattr(importlib.import_module(f"{__name__}.{framework}.patches"), "check_settings", None)
        if check is not None:
            check(environ)


def variable_names() -> tuple[str, ...]:
    """Every environment variable the package reads: the one table's (megatron_rl_patches/settings.py)."""
    from megatron_rl_patches import settings

    return settings.READ


def default_registry() -> Registry:
    """The process-wide registry of every patch this package knows (built once)."""
    global _default  # not an argument: patching names this function by a string and calls it with none
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
    from megatron_rl_patches.integrations import _ray as ray

    ray.arm()
    return statuses


def revert(only: Any = None) -> PatchStatuses:
    """Remove the patches (all, or those named), restoring the originals exactly. Idempotent."""
    statuses = default_registry().revert(only)
    if only is None:
        from megatron_rl_patches.integrations import _ray as ray

        ray.disarm()
    return statuses


def applied() -> PatchStatuses:
    """One status per (patch, target): applied / pending / skipped / failed, with a reason; printed,
    one line per patch. Warns once when MEGATRON_RL_PATCHES is set but start-up patching did not run."""
    hook.warn_if_not_run()
    return default_registry().applied()


# Module paths from before one package per framework. The custom-loss path that
# slime's --custom-loss-function-path names stays silent: users type it.
_aliases.install(__name__, {
    "megatron_core": "megatron_rl_patches.integrations.megatron.core",
    "megatron_lm": "megatron_rl_patches.integrations.megatron.patches",
    "megatron_version": "megatron_rl_patches.integrations.megatron.version",
    "train_reentry": "megatron_rl_patches.integrations.megatron.train_reentry",
    "gpt_signature": "megatron_rl_patches.processors.gpt_signature",
    "slime_fused": "megatron_rl_patches.integrations.slime.fused",
    "slime_opd": "megatron_rl_patches.integrations.slime.opd",
    "slime_opd_settings": "megatron_rl_patches.integrations.megatron.opd.opd_settings",
    "slime_roles": "megatron_rl_patches.integrations.slime.roles",
    "slime_rows": "megatron_rl_patches.integrations.slime.rows",
    "slime_topk": "megatron_rl_patches.integrations.slime.topk",
    "verl_rows": "megatron_rl_patches.integrations.verl.rows",
    "verl_topk": "megatron_rl_patches.integrations.verl.topk",
    "ray": "megatron_rl_patches.integrations._ray",
    # the iterators carrying a step's fused call, named for what they carry (issue 113)
    "megatron.planned_iterators": "megatron_rl_patches.integrations.megatron.step_iterators",
}, silent=("slime_opd",))
