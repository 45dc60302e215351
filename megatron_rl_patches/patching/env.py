"""Environment variables -> patch selection. Pure string handling; imports nothing heavy."""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

SELECT = "MEGATRON_RL_PATCHES"
DISABLE = "MEGATRON_RL_PATCHES_DISABLE"
STRICT = "MEGATRON_RL_PATCHES_STRICT"
INFERENCE_ROLES = "MEGATRON_RL_PATCHES_INFERENCE_ROLES"

DEFAULT_INFERENCE_ROLES = ("prm_teacher", "teacher")
_OFF = {"", "0", "false", "no", "off", "none"}
_ALL = {"1", "all", "true", "yes", "on"}


def _environ(environ: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if environ is None else environ


def split_names(value: str | Sequence[str] | None) -> list[str]:
    """'a, b,,c' -> ['a', 'b', 'c']; a sequence is taken as already split."""
    if value is None:
        return []
    items = value.split(",") if isinstance(value, str) else list(value)
    return [item.strip() for item in items if item and item.strip()]


def is_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """True when MEGATRON_RL_PATCHES asks for patching at start-up (unset, '' or '0' = off)."""
    return _environ(environ).get(SELECT, "").strip().lower() not in _OFF


def selected_names(environ: Mapping[str, str] | None = None) -> list[str] | None:
    """Names MEGATRON_RL_PATCHES lists, or None when it means 'every patch' (or is off)."""
    value = _environ(environ).get(SELECT, "").strip()
    if value.lower() in _OFF or value.lower() in _ALL:
        return None
    return split_names(value)


def disabled_names(environ: Mapping[str, str] | None = None) -> list[str]:
    return split_names(_environ(environ).get(DISABLE))


def is_strict(environ: Mapping[str, str] | None = None) -> bool:
    return _environ(environ).get(STRICT, "").strip().lower() in _ALL


def inference_roles(environ: Mapping[str, str] | None = None) -> list[str]:
    """Roles built inference-only; unset means the default teacher roles, '' means none."""
    value = _environ(environ).get(INFERENCE_ROLES)
    return list(DEFAULT_INFERENCE_ROLES) if value is None else split_names(value)


def resolve_selection(
    known: Sequence[str],
    only: str | Sequence[str] | None = None,
    exclude: str | Sequence[str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> list[str]:
    """The patch names to apply: arguments beat the environment; DISABLE drops names unless
    `only` names them. Unknown names raise ValueError listing the valid ones."""
    only_names = split_names(only) if only is not None else None
    exclude_names = split_names(exclude)
    env_names = selected_names(environ)
    disabled = disabled_names(environ)
    for source, names in (
        ("only", only_names or []),
        ("exclude", exclude_names),
        (SELECT, (env_names or []) if only_names is None else []),
        (DISABLE, disabled),
    ):
        unknown = [name for name in names if name not in known]
        if unknown:
            raise ValueError(
                f"unknown patch name(s) {', '.join(map(repr, unknown))} in {source}; "
                f"valid names: {', '.join(known)}"
            )
    if only_names is not None:
        chosen = only_names
    elif env_names is not None:
        chosen = [name for name in env_names if name not in disabled]
    else:
        chosen = [name for name in known if name not in disabled]
    return [name for name in dict.fromkeys(chosen) if name not in exclude_names]
