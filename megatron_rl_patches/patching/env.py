"""Environment variables -> patch selection: which patches MEGATRON_RL_PATCHES and
MEGATRON_RL_PATCHES_DISABLE select among the registry's, the misspelled-name check, and the checks and
summary of every variable the launcher and `doctor` make. Every variable's text is read by its one parser
in megatron_rl_patches/settings.py (`SETTINGS`, `read_settings`): this module has none of its own; its
readers (`is_strict`, `role_layouts`, ...) are the settings' readers under the names the patch machinery
calls. Pure string handling; imports nothing heavy."""
from __future__ import annotations

import megatron_rl_patches.settings as settings
from megatron_rl_patches.settings import (
    ALLOW_UNTESTED,
    AUTO,
    BACKEND,
    DISABLE,
    EVERY,
    INFERENCE_ROLES,
    INVARIANT,
    NATIVE,
    PREFIX,
    SELECT,
    SHARED_PREFIX,
    STRICT,
    VARIABLES,
    VERL_ROWS,
    cut,
    environment,
    read_settings,
    role_layouts_of,
    role_names_of,
    role_residencies_of,
    selection_enabled,
    text,
)
from megatron_rl_patches.settings import LAUNCHER_ROOT as LAUNCHER_ROOT
from megatron_rl_patches.settings import RESIDENCY_MODES as RESIDENCY_MODES
from megatron_rl_patches.settings import split_names as split_names

# Not `from typing import TYPE_CHECKING`: this module runs at every interpreter start-up and
# importing typing costs more than everything else the start-up hook does (type checkers
# treat this name specially either way).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

# The settings' readers under the names the patch machinery calls (one reader per setting).
is_strict, allows_untested = settings.strict, settings.allow_untested
backend, invariant, native = settings.backend, settings.invariant, settings.native
verl_rows, shared_prefix = settings.verl_rows, settings.shared_prefix

_PREFIX = PREFIX.removesuffix("ES")  # MEGATRON_RL_PATCH: a variable starting so (any case) is meant for us


def shown_value(name: str, environ: Mapping[str, str] | None = None) -> str:
    """The variable `name`'s value as messages show it: cut to a readable length."""
    return cut(str(text(environ, name)))


def is_off(environ: Mapping[str, str] | None = None) -> bool:
    """True when MEGATRON_RL_PATCHES is set to an explicit "off" word (0, false, no, off, none)."""
    raw = text(environ, SELECT)
    return bool((raw or "").strip()) and not selection_enabled(raw)


def is_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """True when MEGATRON_RL_PATCHES asks for patching at start-up (unset, '' or '0' = off); never raises."""
    return selection_enabled(text(environ, SELECT))


def selected_names(environ: Mapping[str, str] | None = None) -> list[str] | None:
    """Names MEGATRON_RL_PATCHES lists, or None when it means 'every patch' (or is off); ValueError
    naming the variable when it names no patch."""
    value = settings.selection(environ)
    return None if value is None or value == EVERY else list(value)


def disabled_names(environ: Mapping[str, str] | None = None) -> list[str]:
    """Names MEGATRON_RL_PATCHES_DISABLE lists (removed from any selection but `only=`)."""
    return list(settings.disabled(environ))


def role_names(environ: Mapping[str, str] | None = None) -> list[str] | None:
    """The role names MEGATRON_RL_PATCHES_INFERENCE_ROLES lists ('' means none); None when unset."""
    return role_names_of(text(environ, INFERENCE_ROLES))


def role_residencies(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Residency per role from MEGATRON_RL_PATCHES_INFERENCE_ROLES entries `role:residency`."""
    return role_residencies_of(text(environ, INFERENCE_ROLES))


def role_layouts(environ: Mapping[str, str] | None = None) -> dict[str, int]:
    """The role's own tensor-parallel size per role from MEGATRON_RL_PATCHES_INFERENCE_ROLES entries
    `role;tp=N` (ValueError naming the variable for a bad option)."""
    return role_layouts_of(text(environ, INFERENCE_ROLES))


def checked_role_names(environ: Mapping[str, str] | None = None) -> list[str] | None:
    """:func:`role_names`, checked (`settings.roles_setting`); '' still means none."""
    roles = settings.inference_roles(environ)
    return None if roles is None else list(roles)


_LISTED = 5  # unknown names an error message shows (each cut by `cut`)


def _suggestions(unknown: Sequence[str], known: Sequence[str]) -> str:
    """' (did you mean ddp_hooks?)' for the unknown names with a close known one; '' when none has."""
    import difflib  # lazy: import cost: only on this error path (start-up stays light)

    close = {name: difflib.get_close_matches(name.strip().lower(), known, n=1, cutoff=0.6) for name in unknown}
    found = {name: match[0] for name, match in close.items() if match}
    if not found:
        return ""
    if len(unknown) == 1:
        return f" (did you mean {found[unknown[0]]}?)"
    return f" (did you mean {', '.join(f'{match} for {cut(name)!r}' for name, match in found.items())}?)"


def check_variable_names(known: Sequence[str], environ: Mapping[str, str] | None = None) -> None:
    """ValueError naming each variable of `environ` that starts like ours (MEGATRON_RL_PATCH..., any
    case) but is none of `known`, with the close known name ("did you mean ...?"): a misspelled
    setting would otherwise be ignored and its default used without a word."""
    import difflib  # lazy: import cost: start-up imports it only when a variable of ours is set

    names = [name for name in environment(environ) if name.upper().startswith(_PREFIX)]
    unknown = sorted(name for name in names if name not in known)
    if not unknown:
        return
    hints = []
    for name in unknown[:_LISTED]:
        close = difflib.get_close_matches(name.upper(), known, n=1, cutoff=0.6)
        hints.append(f"{cut(name)}" + (f" (did you mean {close[0]}?)" if close else ""))
    more = f" and {len(unknown) - _LISTED} more" if len(unknown) > _LISTED else ""
    raise ValueError(f"unknown variable(s) {', '.join(hints)}{more}: megatron-rl-patches reads none of them; "
                     "rename or unset them (`megatron-rl-patches run --help` lists its variables)")


def check_names(source: str, names: Sequence[str], known: Sequence[str]) -> None:
    """ValueError naming `source` (the variable or argument the names came from), the unknown
    names, the close known ones ("did you mean ddp_hooks?") and every valid name."""
    unknown = list(dict.fromkeys(name for name in names if name not in known))
    if unknown:
        shown = ", ".join(repr(cut(name)) for name in unknown[:_LISTED])
        more = f" and {len(unknown) - _LISTED} more" if len(unknown) > _LISTED else ""
        raise ValueError(f"unknown patch name(s) {shown}{more} in {source}{_suggestions(unknown[:_LISTED], known)}; "
                         f"valid names: {', '.join(known)}")


def selection(
    known: Sequence[str],
    only: str | Sequence[str] | None = None,
    exclude: str | Sequence[str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> dict[str, str | None]:
    """Each name of `known`, in order, with its fate: None when selected, else why not — "" when
    nothing asked for it, "disabled by ..." when `exclude` or MEGATRON_RL_PATCHES_DISABLE removed it.

    `only` beats MEGATRON_RL_PATCHES, which beats "every patch"; MEGATRON_RL_PATCHES_DISABLE
    drops names unless `only` is given; `exclude` always drops. Unknown names in whatever is
    consulted raise ValueError listing the valid ones (the environment is not read at all
    when `only` is given, so a typo there cannot break explicit code).
    """
    only_names = split_names(only) if only is not None else None
    exclude_names = split_names(exclude)
    disabled: list[str] = []
    if only_names is not None:
        check_names("only=", only_names, known)
        check_names("exclude=", exclude_names, known)
        asked = set(only_names)
    else:
        env_names = selected_names(environ)
        disabled = disabled_names(environ)
        if env_names is not None:
            check_names(SELECT, env_names, known)
        check_names(DISABLE, disabled, known)
        check_names("exclude=", exclude_names, known)
        asked = set(known if env_names is None else env_names)
    fates: dict[str, str | None] = {}
    for name in dict.fromkeys(known):
        if name in exclude_names:
            fates[name] = "disabled by exclude="
        elif name in disabled:
            fates[name] = f"disabled by {DISABLE}"
        else:
            fates[name] = None if name in asked else ""
    return fates


def resolve_selection(
    known: Sequence[str],
    only: str | Sequence[str] | None = None,
    exclude: str | Sequence[str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> list[str]:
    """The patch names to apply, in `known` order (see :func:`selection`)."""
    return [name for name, fate in selection(known, only, exclude, environ).items() if fate is None]


def check(known: Sequence[str], environ: Mapping[str, str] | None = None) -> list[str]:
    """Every variable of ours in `environ`, checked as `megatron-rl-patches run` passes them on: each read
    by its parser (`settings.read_settings`: the first refusal raised, naming its variable), the patch
    names known, and a selection that leaves some patch. Returns the patch names selected."""
    environ = environment(environ)
    refusals = read_settings(environ).refusals
    if refusals:
        raise ValueError(next(iter(refusals.values())))
    chosen = resolve_selection(known, environ=environ)
    if not chosen:
        raise ValueError(f"{DISABLE}={cut(text(environ, DISABLE) or '')!r} leaves out every patch selected: nothing "
                         "would be applied; unset it or select other patches")
    return chosen


def summary(environ: Mapping[str, str] | None = None) -> dict[str, object]:
    """The raw variables and what they mean, for `megatron-rl-patches doctor`: every variable read by
    its parser (`settings.read_settings`, as the launcher and the start-up hook read it); a variable
    refused reads as None, its refusal in "refusals" (by name) and "errors"."""
    env = environment(environ)
    readings = read_settings(env)
    values = readings.values
    return {
        "variables": {name: text(env, name) for name in VARIABLES},
        "enabled_at_startup": is_enabled(env),
        "selects": _shown(values[SELECT]),  # None: off (or refused); "all"; else the names
        "disabled": _shown(values[DISABLE]) or [],
        "strict": values[STRICT],
        "allow_untested": values[ALLOW_UNTESTED],
        "inference_roles": _shown(values[INFERENCE_ROLES]),  # None: unset (the framework's default roles) or refused
        "backend": None if values[BACKEND] == AUTO else values[BACKEND],  # None: each op chooses (or refused)
        "invariant": values[INVARIANT],  # None: unset (an op's argument, else the model config) or refused
        "native": values[NATIVE],
        "verl_rows": values[VERL_ROWS],
        "shared_prefix": values[SHARED_PREFIX],
        "refusals": dict(readings.refusals),
        "errors": list(readings.refusals.values()),
    }


def _shown(meaning: object) -> object:
    """A setting's meaning as `doctor`'s JSON shows it: names as a list."""
    return list(meaning) if isinstance(meaning, tuple) else meaning
