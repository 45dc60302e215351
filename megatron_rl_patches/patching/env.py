"""Environment variables -> patch selection. Pure string handling; imports nothing heavy."""
from __future__ import annotations

import os

from megatron_rl_patches.settings import (
    ALLOW_UNTESTED,
    AUTO,
    BACKEND,
    DISABLE,
    INFERENCE_ROLES,
    INVARIANT,
    NATIVE,
    PREFIX,
    RESIDENCY_MODES,
    SELECT,
    SHARED_PREFIX,
    STRICT,
    VARIABLES,
    VERL_ROWS,
    invariant_setting,
    is_layout_option,
    layout_size,
    native_setting,
    parse_backend,
    shared_prefix_setting,
    verl_rows_setting,
)
from megatron_rl_patches.settings import (
    LAUNCHER_ROOT as LAUNCHER_ROOT,
)

# Not `from typing import TYPE_CHECKING`: this module runs at every interpreter start-up and
# importing typing costs more than everything else the start-up hook does (type checkers
# treat this name specially either way).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

# The names come from the one table (megatron_rl_patches/settings.py); VARIABLES: every one a user sets.
_PREFIX = PREFIX.removesuffix("ES")  # MEGATRON_RL_PATCH: a variable starting so (any case) is meant for us

_OFF = {"", "0", "false", "no", "off", "none"}
_ALL = {"1", "all", "true", "yes", "on"}
# The yes/no variables (STRICT, ALLOW_UNTESTED) accept exactly these; anything else is an error.
_YES = ("1", "true", "yes", "on")
_NO = ("0", "false", "no", "off", "")


def _environ(environ: Mapping[str, str] | None) -> Mapping[str, str]:
    if environ is None:
        return os.environ
    if not callable(getattr(environ, "get", None)):
        raise TypeError(
            f"environ must be a mapping of variable names to strings (like os.environ), got {type(environ).__name__}"
        )
    return environ


def _get(environ: Mapping[str, str] | None, name: str) -> str | None:
    """The variable's value (None when unset); TypeError naming it when a mapping holds a non-string."""
    value = _environ(environ).get(name)
    if value is not None and not isinstance(value, str):
        raise TypeError(
            f"environ[{name!r}] must be a string (environment values are), "
            f"got {type(value).__name__} {_cut(repr(value))}"
        )
    return value


def _cut(text: str, limit: int = 40) -> str:
    """`text`, shortened to `limit` characters with '...' (a pasted megabyte must not flood stderr)."""
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def shown_value(name: str, environ: Mapping[str, str] | None = None) -> str:
    """The variable `name`'s value as messages show it: cut to a readable length."""
    return _cut(str(_get(environ, name)))


def _flag(environ: Mapping[str, str] | None, name: str) -> bool:
    """A yes/no variable; ValueError listing the accepted values for anything else."""
    value = _get(environ, name) or ""
    word = value.strip().lower()
    if word in _YES or word in _NO:
        return word in _YES
    raise ValueError(
        f"{name}={_cut(value)!r} is not a yes/no value: use {'/'.join(_YES)} to turn it on, "
        f"{'/'.join(_NO[:-1])} or \"\" (unset) to turn it off"
    )


def split_names(value: str | Sequence[str] | None) -> list[str]:
    """'a, b,,c' -> ['a', 'b', 'c']; a sequence is taken as already split."""
    if value is None:
        return []
    if not isinstance(value, str):
        if not isinstance(value, (list, tuple, set, frozenset)):
            raise TypeError(f"patch names must be a string or a list of strings, got {value!r}")
        bad = [item for item in value if not isinstance(item, str)]
        if bad:
            raise TypeError(f"patch names must be strings, got {bad!r}; pass e.g. ['ddp_hooks']")
    items = value.split(",") if isinstance(value, str) else list(value)
    return [item.strip() for item in items if item and item.strip()]


def is_off(environ: Mapping[str, str] | None = None) -> bool:
    """True when MEGATRON_RL_PATCHES is set to an explicit "off" word (0, false, no, off, none)."""
    word = (_get(environ, SELECT) or "").strip().lower()
    return bool(word) and word in _OFF


def is_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """True when MEGATRON_RL_PATCHES asks for patching at start-up (unset, '' or '0' = off)."""
    return (_get(environ, SELECT) or "").strip().lower() not in _OFF


def selected_names(environ: Mapping[str, str] | None = None) -> list[str] | None:
    """Names MEGATRON_RL_PATCHES lists, or None when it means 'every patch' (or is off)."""
    value = (_get(environ, SELECT) or "").strip()
    if value.lower() in _OFF or value.lower() in _ALL:
        return None
    return split_names(value)


def disabled_names(environ: Mapping[str, str] | None = None) -> list[str]:
    """Names MEGATRON_RL_PATCHES_DISABLE lists (removed from any selection but `only=`)."""
    return split_names(_get(environ, DISABLE))


def is_strict(environ: Mapping[str, str] | None = None) -> bool:
    """MEGATRON_RL_PATCHES_STRICT=1: patch problems raise instead of warning."""
    return _flag(environ, STRICT)


def allows_untested(environ: Mapping[str, str] | None = None) -> bool:
    """MEGATRON_RL_PATCHES_ALLOW_UNTESTED=1: apply patches outside their supported version range."""
    return _flag(environ, ALLOW_UNTESTED)


def role_names(environ: Mapping[str, str] | None = None) -> list[str] | None:
    """The role names MEGATRON_RL_PATCHES_INFERENCE_ROLES lists ('' means none); None when unset
    (the integration that reads it has its default roles). Each entry is `role` or `role:residency`."""
    value = _get(environ, INFERENCE_ROLES)
    return None if value is None else [item.split(";")[0].partition(":")[0].strip() for item in split_names(value)]


def role_residencies(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Residency per role from MEGATRON_RL_PATCHES_INFERENCE_ROLES entries `role:residency`
    (e.g. 'judge:stream,ref:swap'); roles listed without one are absent (resident)."""
    entries = [item.split(";")[0].partition(":") for item in split_names(_get(environ, INFERENCE_ROLES))]
    return {name.strip(): mode.strip().lower() for name, colon, mode in entries if colon}


def role_layouts(environ: Mapping[str, str] | None = None) -> dict[str, int]:
    """The role's own tensor-parallel size (its model's layout) per role from MEGATRON_RL_PATCHES_INFERENCE_ROLES
    entries `role;tp=N` or `role:MODE;tp=N` (any residency; roles without one are absent: built in the
    student's process groups); each option checked (ValueError naming the variable)."""
    layouts: dict[str, int] = {}
    for item in split_names(_get(environ, INFERENCE_ROLES)):
        head, *options = item.split(";")
        name = head.partition(":")[0]  # the residency (any mode) is role_residencies'
        where = f"{INFERENCE_ROLES} role {_cut(item)!r}"
        sizes: dict[str, int] = {}
        for written in (option.strip() for option in options):
            if not is_layout_option(written):
                raise ValueError(f"{where}: unknown option {_cut(written)!r}; the option is ';tp=N' (the role's "
                                 "model at its own tensor-parallel size, e.g. judge;tp=2)")
            size, value = layout_size(written, where)
            if size in sizes:
                raise ValueError(f"{where}: option {size!r} given twice; give each option once")
            sizes[size] = value
        if sizes.get("pp", 1) > 1:  # a role at its own layout is built and scored at its own tp only
            raise ValueError(f"{where}: option 'pp={sizes['pp']}': a role's model at its own pipeline-parallel "
                             "size is not served yet (a role at its own layout takes ';tp=N'; an own pipeline is "
                             "served for MEGATRON_RL_PATCHES_OPD_TEACHERS entries 'PATH;pp=N'); drop it or use 1")
        if "tp" in sizes:
            layouts[name.strip()] = sizes["tp"]
    return layouts


def backend(environ: Mapping[str, str] | None = None) -> str | None:
    """MEGATRON_RL_PATCHES_BACKEND: "torch" or "triton"; None when unset, "" or "auto" (the ops
    choose). The ops read it with the same parser (:mod:`megatron_rl_patches.settings`)."""
    word = parse_backend(_get(environ, BACKEND))
    return None if word == AUTO else word


def invariant(environ: Mapping[str, str] | None = None) -> bool | None:
    """MEGATRON_RL_PATCHES_INVARIANT: True / False, None when unset or "" (the ops read it with the
    same parser); ValueError naming the variable for any other word."""
    return invariant_setting(_get(environ, INVARIANT))


def native(environ: Mapping[str, str] | None = None) -> bool:
    """MEGATRON_RL_PATCHES_NATIVE: False when off (the invariant mode's CPU sums on the torch tiles),
    else True (the ops read it with the same parser); ValueError naming the variable for any other word."""
    return native_setting(_get(environ, NATIVE))


def verl_rows(environ: Mapping[str, str] | None = None) -> bool:
    """MEGATRON_RL_PATCHES_VERL_ROWS=all (verl_fused_logprobs computes every row); ValueError naming
    the variable for any other word than "all" or ""."""
    return verl_rows_setting(_get(environ, VERL_ROWS))


def shared_prefix(environ: Mapping[str, str] | None = None) -> bool:
    """MEGATRON_RL_PATCHES_SHARED_PREFIX: whether the framework passes pack by shared prefix (off when
    unset); ValueError naming the variable for any other word than a switch."""
    return shared_prefix_setting(_get(environ, SHARED_PREFIX))


def checked_role_names(environ: Mapping[str, str] | None = None) -> list[str] | None:
    """:func:`role_names`, refusing a value that names no role or a name that is not an
    identifier (ValueError naming the variable); '' still means none. Syntax only: which roles
    exist is the framework's business."""
    value = _get(environ, INFERENCE_ROLES)
    roles = role_names(environ)
    if value and not roles:
        raise ValueError(f"{INFERENCE_ROLES}={_cut(value)!r} names no role: list role names (comma-separated), "
                         f"set it to \"\" for none, or unset it for the default")
    bad = [role for role in roles or () if not role.isidentifier()]
    if bad:
        raise ValueError(f"{INFERENCE_ROLES}={_cut(value or '')!r}: {_cut(bad[0])!r} is not a role name; role names "
                         f"are identifiers (letters, digits, '_'), comma-separated")
    twice = [role for index, role in enumerate(roles or ()) if role in (roles or ())[:index]]
    if twice:
        raise ValueError(f"{INFERENCE_ROLES}={_cut(value or '')!r} lists role {_cut(twice[0])!r} more than once; "
                         "list each role once (role, or role:residency)")
    role_layouts(environ)
    modes = role_residencies(environ)
    wrong = [(role, mode) for role, mode in modes.items() if mode not in RESIDENCY_MODES]
    if wrong:
        raise ValueError(f"{INFERENCE_ROLES}={_cut(value or '')!r}: role {_cut(wrong[0][0])!r} has residency "
                         f"{_cut(wrong[0][1])!r}; use role:{'|'.join(RESIDENCY_MODES)} (e.g. ref:stream), or the "
                         "role alone for resident")
    return roles


_LISTED = 5  # unknown names an error message shows (each cut by _cut)


def _suggestions(unknown: Sequence[str], known: Sequence[str]) -> str:
    """' (did you mean ddp_hooks?)' for the unknown names with a close known one; '' when none has."""
    import difflib  # lazy: import cost: only on this error path (start-up stays light)

    close = {name: difflib.get_close_matches(name.strip().lower(), known, n=1, cutoff=0.6) for name in unknown}
    found = {name: match[0] for name, match in close.items() if match}
    if not found:
        return ""
    if len(unknown) == 1:
        return f" (did you mean {found[unknown[0]]}?)"
    return f" (did you mean {', '.join(f'{match} for {_cut(name)!r}' for name, match in found.items())}?)"


def check_variable_names(known: Sequence[str], environ: Mapping[str, str] | None = None) -> None:
    """ValueError naming each variable of `environ` that starts like ours (MEGATRON_RL_PATCH..., any
    case) but is none of `known`, with the close known name ("did you mean ...?"): a misspelled
    setting would otherwise be ignored and its default used without a word."""
    import difflib  # lazy: import cost: start-up imports it only when a variable of ours is set

    names = [name for name in _environ(environ) if name.upper().startswith(_PREFIX)]
    unknown = sorted(name for name in names if name not in known)
    if not unknown:
        return
    hints = []
    for name in unknown[:_LISTED]:
        close = difflib.get_close_matches(name.upper(), known, n=1, cutoff=0.6)
        hints.append(f"{_cut(name)}" + (f" (did you mean {close[0]}?)" if close else ""))
    more = f" and {len(unknown) - _LISTED} more" if len(unknown) > _LISTED else ""
    raise ValueError(f"unknown variable(s) {', '.join(hints)}{more}: megatron-rl-patches reads none of them; "
                     "rename or unset them (`megatron-rl-patches run --help` lists its variables)")


def check_names(source: str, names: Sequence[str], known: Sequence[str]) -> None:
    """ValueError naming `source` (the variable or argument the names came from), the unknown
    names, the close known ones ("did you mean ddp_hooks?") and every valid name."""
    unknown = list(dict.fromkeys(name for name in names if name not in known))
    if unknown:
        shown = ", ".join(repr(_cut(name)) for name in unknown[:_LISTED])
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
    """Every variable of ours in `environ`, checked as `megatron-rl-patches run` passes them on:
    names known, yes/no words, the backend, the roles' syntax, and a selection that names some
    patch. Returns the patch names selected; ValueError naming the variable otherwise."""
    environ = _environ(environ)
    select = _get(environ, SELECT) or ""
    if select.strip().lower() not in _OFF | _ALL and not selected_names(environ):
        raise ValueError(f"{SELECT}={_cut(select)!r} names no patch: use all or patch names ({', '.join(known)})")
    disabled = _get(environ, DISABLE) or ""
    if disabled.strip() and not disabled_names(environ):
        raise ValueError(f"{DISABLE}={_cut(disabled)!r} names no patch: list patch names to leave out, or unset it")
    chosen = resolve_selection(known, environ=environ)
    is_strict(environ)
    allows_untested(environ)
    backend(environ)
    invariant(environ)
    native(environ)
    verl_rows(environ)
    checked_role_names(environ)
    if not chosen:
        raise ValueError(f"{DISABLE}={_cut(disabled)!r} leaves out every patch selected: nothing would be "
                         f"applied; unset it or select other patches")
    return chosen


def summary(environ: Mapping[str, str] | None = None) -> dict[str, object]:
    """The raw variables and what they mean, for `megatron-rl-patches doctor`; a yes/no or backend
    variable with an unknown value reads as None, its error in "errors"."""
    env = _environ(environ)
    names = selected_names(env)
    enabled = is_enabled(env)
    errors: list[str] = []

    def read(reader: Callable[[Mapping[str, str]], object]) -> object:
        try:
            return reader(env)
        except ValueError as exc:
            errors.append(str(exc))
            return None

    return {
        "variables": {name: env.get(name) for name in VARIABLES},
        "enabled_at_startup": enabled,
        "selects": None if not enabled else "all" if names is None else names,
        "disabled": disabled_names(env),
        "strict": read(is_strict),
        "allow_untested": read(allows_untested),
        "inference_roles": read(checked_role_names),  # None: unset (the framework's default roles) or wrong
        "backend": read(backend),
        "invariant": read(invariant),  # None: unset (an op's argument, else the model config) or wrong
        "verl_rows": read(verl_rows),
        "shared_prefix": read(shared_prefix),
        "errors": errors,
    }
