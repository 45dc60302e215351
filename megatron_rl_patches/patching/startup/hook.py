"""Start-up hook run by the installed .pth (and .start) file in every Python process.

With MEGATRON_RL_PATCHES unset it returns after one environment read and imports nothing more.
With it set, it registers post-import hooks; the patches land when megatron is imported.
It never raises: Python's site machinery would print a traceback (twice in a venv) and go on.
"""
from __future__ import annotations

import sys

from megatron_rl_patches.patching import DEFAULT_REGISTRY, load_registry

_done = False


def has_run() -> bool:
    """Whether the start-up hook already ran in this process."""
    return _done


_LINE_LIMIT = 2000  # characters of one start-up message


def _say(message: str) -> None:
    """One stderr line, from the first rank only (every rank would print the same). Never raises:
    stderr may be closed (None) or unwritable, and the user's program must start regardless."""
    try:
        from megatron_rl_patches._log import launcher_rank

        if launcher_rank() == 0 and sys.stderr is not None:
            cut = message if len(message) <= _LINE_LIMIT else f"{message[: _LINE_LIMIT - 3]}..."
            sys.stderr.write(f"megatron-rl-patches: {cut}\n")
            sys.stderr.flush()
    except Exception:  # noqa: BLE001 - nowhere left to report it
        pass


def _strict() -> bool:
    """MEGATRON_RL_PATCHES_STRICT, read as False when its value is itself the error reported."""
    from megatron_rl_patches.patching import env

    try:
        return env.is_strict()
    except ValueError:
        return False


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
        registry = load_registry(registry_factory)
        try:
            registry.apply()
        except ValueError as exc:  # bad selection or yes/no value: one line now; strict: also at import
            _say(f"no patch applied at start-up: {exc}")
            if _strict():
                registry.poison_imports(ValueError(f"{exc} ({env.STRICT} is set)"))
        for read in (env.backend, env.checked_inference_roles):  # read later, by the ops and the roles
            try:
                read()
            except ValueError as exc:
                _say(str(exc))
    except BaseException as exc:  # noqa: BLE001 - start-up must go on whatever happens
        _say(f"start-up patching disabled: {type(exc).__name__}: {exc}")
