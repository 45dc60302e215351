"""Ray: `apply()` in a driver does not reach its actors (each is a fresh process). Once `apply()`
ran in this process, `ray.init` warns (once) when its runtime_env does not pass
MEGATRON_RL_PATCHES to the workers. Nothing else about Ray is changed."""
from __future__ import annotations

import sys
import threading
from typing import Any

import wrapt

from megatron_rl_patches._log import warn_once
from megatron_rl_patches.patching.wrappers import patch_key, wrap

_state = {"armed": False, "hooked": False}
_lock = threading.RLock()  # apply()/revert() from several threads, and ray's import hook

ADVICE = (
    "patches were applied with apply() in this Ray driver, but apply() does not reach Ray's worker "
    "processes and this ray.init() does not pass MEGATRON_RL_PATCHES to them: use "
    "ray.init(runtime_env={'env_vars': {'MEGATRON_RL_PATCHES': 'all'}}) (or the launcher "
    "`megatron-rl-patches run -- ...`) so every actor applies them at start-up"
)


def _carries_selection(runtime_env: Any) -> bool:
    env_vars = runtime_env.get("env_vars") if isinstance(runtime_env, dict) else getattr(runtime_env, "env_vars", None)
    return isinstance(env_vars, dict) and str(env_vars.get("MEGATRON_RL_PATCHES", "")).strip() not in ("", "0")


def init_wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    if _state["armed"] and not _carries_selection(kwargs.get("runtime_env")):
        warn_once(ADVICE)
    return wrapped(*args, **kwargs)


KEY = ("ray", "ray:init")  # marks our wrapper (not a registry record: the registry never sees it)


def _is_ours(init: Any) -> bool:
    return patch_key(init) == KEY


def _wrap(module: Any) -> None:
    with _lock:
        init = getattr(module, "init", None)
        if not _state["armed"] or init is None or _is_ours(init):
            return
        wrap(module, "init", init_wrapper, key=KEY)


def arm() -> None:
    """Called by apply(): from now on ray.init checks its runtime_env (Ray imported now or later)."""
    with _lock:
        _state["armed"] = True
        if "ray" in sys.modules:
            _wrap(sys.modules["ray"])
        hook, _state["hooked"] = not _state["hooked"], True
    if hook:  # fires on every later import of ray (also after a re-import)

        wrapt.register_post_import_hook(_wrap, "ray")


def disarm() -> None:
    """Called by revert(): ray.init is itself again (the wrapper, if installed, is removed)."""
    with _lock:
        _state["armed"] = False
        ray = sys.modules.get("ray")
        init = getattr(ray, "init", None) if ray is not None else None
        if init is not None and _is_ours(init):
            wrapt.unwrap_object(ray, "init", init)
