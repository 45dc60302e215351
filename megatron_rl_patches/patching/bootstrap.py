"""Start-up hook run by the installed .pth (and .start) file in every Python process.

With MEGATRON_RL_PATCHES unset it returns after one environment read and imports nothing more.
With it set, it registers post-import hooks; the patches land when megatron is imported.
It never raises: Python's site machinery would print a traceback (twice in a venv) and go on.
"""
from __future__ import annotations

import sys

_done = False


def has_run() -> bool:
    """Whether the start-up hook already ran in this process."""
    return _done


def _say(message: str) -> None:
    """One stderr line, from the first rank only (every rank would print the same)."""
    from megatron_rl_patches._log import launcher_rank

    if launcher_rank() == 0:
        sys.stderr.write(f"megatron-rl-patches: {message}\n")


# The composition root: where the registry of every known patch is built. A string, so this
# layer names no integration; replaceable for tests and for embedders with their own registry.
DEFAULT_REGISTRY = "megatron_rl_patches.integrations:default_registry"


def run(registry_factory: str = DEFAULT_REGISTRY) -> None:
    """Apply what the environment selects. Idempotent: a venv can execute the same .pth twice."""
    global _done
    if _done:
        return
    _done = True
    try:
        from megatron_rl_patches.patching import env

        if not env.is_enabled():
            return
        import pkgutil

        registry = pkgutil.resolve_name(registry_factory)()
        try:
            registry.apply()
        except ValueError as exc:  # bad selection: one line now; in strict mode, also at import
            _say(f"no patch applied at start-up: {exc}")
            if env.is_strict():
                registry.poison_imports(ValueError(f"{exc} ({env.STRICT} is set)"))
    except BaseException as exc:  # noqa: BLE001 - start-up must go on whatever happens
        _say(f"start-up patching disabled: {type(exc).__name__}: {exc}")
