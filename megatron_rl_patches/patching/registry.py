"""Patch records and their life cycle: apply, revert, statuses, post-import hooks, version guards.

A patch is a declarative record (name, target "module:qualname", wrapper, version range). It is
installed with a wrapt FunctionWrapper when its module is imported (at once if it already is),
and removed with ``wrapt.unwrap_object``. Every wrapper consults a per-target switch, so a
reference captured by ``from x import f`` while patched behaves like the original once reverted.
"""
from __future__ import annotations

import logging
import pkgutil
import sys
import threading
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Mapping, Sequence

import wrapt

from megatron_rl_patches.patching import env

logger = logging.getLogger("megatron_rl_patches")

APPLIED, PENDING, SKIPPED, FAILED = "applied", "pending", "skipped", "failed"

# PatchStatus.code: why a record has its status. The CLI shows `off` for NOT_SELECTED and
# `native` for NATIVE; every other skipped code is a problem worth reading.
NOT_SELECTED, DISABLED, WAITING, NATIVE, VERSION, UNTESTED = (
    "not_selected", "disabled", "waiting_for_import", "native", "version_out_of_range", "outside_range_allowed"
)
MISSING, OPTIONAL_MISSING, SIGNATURE, ERROR, REVERTED, OK = (
    "target_missing", "optional_target_missing", "signature_mismatch", "error", "reverted", "ok"
)
REASON_CODES = (NOT_SELECTED, DISABLED, WAITING, NATIVE, VERSION, UNTESTED, MISSING, OPTIONAL_MISSING,
                SIGNATURE, ERROR, REVERTED, OK)


class PatchError(RuntimeError):
    """A selected patch could not be applied (raised in strict mode only)."""


class PatchTargetMissing(PatchError):
    """The target module exists but the patched attribute does not."""


class PatchSignatureMismatch(PatchError):
    """The target exists but its parameters are not the ones the patch was written for."""


class PatchVersionUnsupported(PatchError):
    """The installed framework version is outside the patch's supported range."""


@dataclass(frozen=True)
class Patch:
    """One (patch name, target) pair: what gets wrapped, with what, and for which versions."""

    name: str
    target: str  # "package.module:Class.attribute"
    wrapper: str | Callable[..., Any]  # wrapt wrapper(wrapped, instance, args, kwargs) or "mod:func"
    description: str
    requires: str | None = "megatron-core"  # distribution whose version is guarded
    versions: str = ""  # PEP 440 specifier; "" = any version
    params: tuple[str, ...] = ()  # parameter names the target must accept, in this order
    optional: bool = False  # a missing target is expected (an alias some versions bind): no error
    # "module:function" returning the version of `requires` in use (e.g. read from a source
    # checkout); None: the installed distribution's metadata.
    version_finder: str | None = None
    native: str = ""  # PEP 440 specifier of the versions that provide the feature themselves

    @property
    def module(self) -> str:
        return self.target.partition(":")[0]

    @property
    def qualname(self) -> str:
        return self.target.partition(":")[2]


@dataclass
class PatchStatus:
    """The state of one (patch, target): applied, pending, skipped or failed, with a reason."""

    name: str
    target: str
    status: str
    reason: str = ""
    code: str = ""  # machine-readable reason: one of REASON_CODES

    def as_dict(self) -> dict[str, str]:
        return asdict(self)


@dataclass
class _Slot:
    """Mutable state of one record."""

    patch: Patch
    status: str = SKIPPED
    reason: str = "not selected"
    code: str = NOT_SELECTED
    selected: bool = False
    strict: bool = False
    allow_untested: bool = False
    active: bool = False  # consulted by every wrapper this slot ever installed
    handle: Any = None  # the installed FunctionWrapper
    owner: Any = None
    attribute: str = ""
    original: Any = None
    impl: Callable[..., Any] | None = field(default=None, repr=False)


_lock = threading.RLock()
_slots: dict[tuple[str, str], _Slot] | None = None
_hooked_modules: set[str] = set()
_warned: set[str] = set()
_deferred: set[str] = set()  # modules met half-imported; their pending patches are retried


def installed_version(distribution: str) -> str | None:
    """The installed version of a distribution, or None when it is not installed as one."""
    import importlib.metadata  # here, not at start-up: ~50 ms that only a target's import needs

    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _catalog() -> dict[tuple[str, str], _Slot]:
    global _slots
    if _slots is None:
        from megatron_rl_patches.integrations import all_patches

        _slots = {(p.name, p.target): _Slot(p) for p in all_patches()}
    return _slots


def patch_names() -> list[str]:
    """Every known patch name, in declaration order."""
    with _lock:
        return list(dict.fromkeys(name for name, _ in _catalog()))


def patches() -> list[Patch]:
    with _lock:
        return [slot.patch for slot in _catalog().values()]


def _is_rank_zero() -> bool:
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return dist.get_rank() == 0
    except Exception:  # a half-torn-down process group: do not hide the warning
        return True
    return env.launcher_rank() == 0  # before init_process_group: what the launcher says


def warn_once(message: str) -> None:
    """One warning line per distinct message per process, from rank 0 only."""
    if message in _warned:
        return
    _warned.add(message)
    if _is_rank_zero():
        logger.warning("megatron-rl-patches: %s", message)
    else:
        logger.debug("megatron-rl-patches: %s", message)


def _resolve_callable(ref: str | Callable[..., Any]) -> Callable[..., Any]:
    """A record's wrapper: the callable itself, or "module:qualname" imported now."""
    return ref if callable(ref) else pkgutil.resolve_name(ref)


def patch_version(patch: Patch) -> str | None:
    """The version of `patch.requires` in use: the record's finder, else distribution metadata."""
    if not patch.requires:
        return None
    if patch.version_finder:
        try:
            return pkgutil.resolve_name(patch.version_finder)()
        except Exception as exc:  # an unreadable checkout: the signature check still guards
            logger.debug("version finder %s failed: %s", patch.version_finder, exc)
            return None
    return installed_version(patch.requires)


def _version_in(found: str, specifier: str) -> bool:
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    return Version(found) in SpecifierSet(specifier, prereleases=True)


def version_problem(patch: Patch) -> str | None:
    """Why the `patch.requires` in use does not fit `patch.versions` (None: it fits or is unknown)."""
    if not patch.requires or not patch.versions:
        return None
    found = patch_version(patch)
    if found is None:  # not installed, or unreadable: the signature check still guards
        return None
    from packaging.specifiers import InvalidSpecifier
    from packaging.version import InvalidVersion

    try:
        ok = _version_in(found, patch.versions)
    except (InvalidVersion, InvalidSpecifier) as exc:
        return f"cannot compare {patch.requires} version {found!r} with {patch.versions!r}: {exc}"
    if ok:
        return None
    # No target in the text: every target of one patch gives the same line, so it warns once.
    return (
        f"installed {patch.requires} {found} is outside the supported range "
        f"'{patch.versions}'; install a supported {patch.requires}, disable '{patch.name}', or set "
        f"{env.ALLOW_UNTESTED}=1 (apply(allow_untested=True)) to apply it anyway"
    )


def native_version(patch: Patch) -> str | None:
    """The version in use when it provides `patch`'s feature itself (None otherwise)."""
    if not patch.native or not patch.requires:
        return None
    found = patch_version(patch)
    try:
        return found if found is not None and _version_in(found, patch.native) else None
    except ValueError:  # packaging's InvalidVersion / InvalidSpecifier
        return None


def _signature_problem(patch: Patch, original: Any) -> str | None:
    if not patch.params:
        return None
    import inspect

    try:
        names = list(inspect.signature(original).parameters)
    except (TypeError, ValueError) as exc:
        return f"cannot read the signature of {patch.target}: {exc}"
    it = iter(names)
    if all(any(p == n for n in it) for p in patch.params):
        return None
    return (
        f"{patch.target} has parameters ({', '.join(names)}); '{patch.name}' expects "
        f"({', '.join(patch.params)}): the installed version changed this function"
    )


def _make_guard(slot: _Slot) -> Callable[..., Any]:
    def guard(wrapped, instance, args, kwargs):
        impl = slot.impl
        if not slot.active or impl is None:
            return wrapped(*args, **kwargs)
        return impl(wrapped, instance, args, kwargs)

    guard.__mrp_key__ = (slot.patch.name, slot.patch.target)  # type: ignore[attr-defined]
    return guard


def _ours(slot: _Slot) -> Callable[[Any], bool]:
    key = (slot.patch.name, slot.patch.target)
    return lambda entry: getattr(getattr(entry, "_self_wrapper", None), "__mrp_key__", None) == key


def _set(slot: _Slot, status: str, reason: str = "", code: str = OK) -> None:
    slot.status, slot.reason, slot.code = status, reason, code


def _refuse(slot: _Slot, error: type[PatchError], reason: str, code: str) -> None:
    _set(slot, SKIPPED, reason, code)
    if slot.strict:
        raise error(reason)
    warn_once(f"'{slot.patch.name}' skipped: {reason}")


def _install(slot: _Slot, module: Any) -> None:
    """Wrap one target of an imported module; record the outcome."""
    patch = slot.patch
    if slot.status == APPLIED:
        return
    native = native_version(patch)
    if native is not None:
        return _set(slot, SKIPPED, f"{patch.requires} {native} provides this itself", NATIVE)
    problem = version_problem(patch)
    untested = ""
    if problem and not slot.allow_untested:
        return _refuse(slot, PatchVersionUnsupported, problem, VERSION)
    if problem:
        untested = f"applied outside its supported range '{patch.versions}' ({patch.requires} {patch_version(patch)})"
        warn_once(f"'{patch.name}' {untested}, as {env.ALLOW_UNTESTED} / allow_untested asked")
    try:
        owner, attribute, original = wrapt.resolve_path(module, patch.qualname)
    except Exception:
        if patch.optional:
            return _set(
                slot, SKIPPED, f"{patch.target} not found (an optional alias: nothing to patch there)", OPTIONAL_MISSING
            )
        return _refuse(
            slot,
            PatchTargetMissing,
            f"{patch.target} not found: {patch.module} has no attribute path '{patch.qualname}'",
            MISSING,
        )
    if wrapt.find_wrapper(original, predicate=_ours(slot)) is not None:
        slot.active = True  # already wrapped (an earlier copy of the registry): never twice
        return _set(slot, APPLIED, "already wrapped")
    problem = _signature_problem(patch, original)
    if problem:
        return _refuse(slot, PatchSignatureMismatch, problem, SIGNATURE)
    try:
        slot.impl = _resolve_callable(patch.wrapper)
        slot.handle = wrapt.wrap_function_wrapper(owner, attribute, _make_guard(slot))
    except Exception as exc:
        _set(slot, FAILED, f"{type(exc).__name__}: {exc}", ERROR)
        if slot.strict:
            raise PatchError(f"'{patch.name}' failed on {patch.target}: {exc}") from exc
        warn_once(f"'{patch.name}' failed on {patch.target}: {type(exc).__name__}: {exc}")
        return
    slot.owner, slot.attribute, slot.original = owner, attribute, original
    slot.active = True
    _set(slot, APPLIED, untested, UNTESTED if untested else OK)


def _on_import(module: Any) -> None:
    """Post-import hook: install every selected patch of `module`; in strict mode the first
    error propagates (after the others were tried), which makes the import itself fail."""
    errors: list[PatchError] = []
    with _lock:
        _hooked_modules.discard(module.__name__)
        for slot in _catalog().values():
            if slot.selected and slot.patch.module == module.__name__:
                try:
                    _install(slot, module)
                except PatchError as exc:
                    errors.append(exc)
    if errors:
        raise errors[0]


def _watch(module_name: str) -> None:
    """Install selected patches of `module_name` now or when it is first imported."""
    module = sys.modules.get(module_name)
    if module is not None and module_name not in _hooked_modules and _initializing(module):
        # apply() ran while the module was still executing (from its own import, or another
        # thread): its attributes may not exist yet. Retried by the next apply()/applied().
        _deferred.add(module_name)
        for slot in _catalog().values():
            if slot.selected and slot.patch.module == module_name and slot.status != APPLIED:
                _set(
                    slot, PENDING, f"{module_name} was still being imported; retried on the next apply()/applied()", WAITING
                )
    elif module is not None:
        _on_import(module)
    elif module_name not in _hooked_modules:
        _hooked_modules.add(module_name)
        wrapt.register_post_import_hook(_on_import, module_name)


def apply(
    only: str | Sequence[str] | None = None,
    exclude: str | Sequence[str] | None = None,
    strict: bool | None = None,
    allow_untested: bool | None = None,
    *,
    environ: Mapping[str, str] | None = None,
) -> list[PatchStatus]:
    """Apply the selected patches (idempotent, additive); returns the statuses of those selected.

    With no arguments: the names MEGATRON_RL_PATCHES lists, else every patch, less
    MEGATRON_RL_PATCHES_DISABLE; `only` ignores the environment. Patches land now for imported
    modules, else when their module is first imported. `strict` (default: the
    MEGATRON_RL_PATCHES_STRICT variable) raises PatchError instead of warning. `allow_untested`
    (default: MEGATRON_RL_PATCHES_ALLOW_UNTESTED) applies a patch outside its supported version
    range with one warning. Unknown names raise ValueError and change nothing.
    """
    if strict is not None and not isinstance(strict, bool):
        raise TypeError(f"strict must be True, False or None (the {env.STRICT} variable), got {strict!r}")
    if allow_untested is not None and not isinstance(allow_untested, bool):
        raise TypeError(
            f"allow_untested must be True, False or None (the {env.ALLOW_UNTESTED} variable), got {allow_untested!r}"
        )
    strict = env.is_strict(environ) if strict is None else strict
    allow_untested = env.allows_untested(environ) if allow_untested is None else allow_untested
    with _lock:
        _retry_deferred()
        chosen = set(env.resolve_selection(patch_names(), only, exclude, environ))
        slots = [slot for slot in _catalog().values() if slot.patch.name in chosen]
        dropped = {name: "disabled by exclude=" for name in env.split_names(exclude)}
        if only is None:
            for name in env.disabled_names(environ):
                dropped.setdefault(name, f"disabled by {env.DISABLE}")
        for slot in _catalog().values():
            if slot.patch.name in chosen:
                slot.selected, slot.strict, slot.allow_untested = True, strict, allow_untested
                if slot.status != APPLIED:
                    _set(slot, PENDING, f"waiting for the import of {slot.patch.module}", WAITING)
            elif not slot.selected and slot.patch.name in dropped:
                _set(slot, SKIPPED, dropped[slot.patch.name], DISABLED)
        errors: list[PatchError] = []
        for module_name in dict.fromkeys(slot.patch.module for slot in slots):
            try:
                _watch(module_name)
            except PatchError as exc:  # strict: still hook the other modules, then raise
                errors.append(exc)
        if errors:
            raise errors[0]
        return [_status(slot) for slot in slots]


def revert(only: str | Sequence[str] | None = None) -> list[PatchStatus]:
    """Remove the patches (all, or those named), restoring the original objects. Idempotent."""
    with _lock:
        names = set(env.resolve_selection(patch_names(), only, environ={})) if only is not None else None
        slots = [s for s in _catalog().values() if names is None or s.patch.name in names]
        for slot in slots:
            in_play = slot.selected or slot.handle is not None or slot.status in (APPLIED, PENDING, FAILED)
            slot.selected = False
            slot.active = False  # a wrapper that cannot be removed (or a captured one) now passes through
            reason = "reverted"
            if slot.handle is not None:
                try:
                    wrapt.unwrap_object(slot.owner, slot.attribute, slot.handle, missing_ok=True)
                except Exception as exc:  # a non-wrapt wrapper was put over ours: ours stays, inert
                    reason = f"reverted; an inert wrapper stays under a foreign one ({exc})"
                slot.handle = slot.owner = slot.original = None
            if in_play:
                _set(slot, SKIPPED, reason, REVERTED)
        return [_status(slot) for slot in slots]


def _status(slot: _Slot) -> PatchStatus:
    return PatchStatus(slot.patch.name, slot.patch.target, slot.status, slot.reason, slot.code)


def _initializing(module: Any) -> bool:
    return bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


def _retry_deferred() -> None:
    """Install the pending patches of modules met half-imported, once their import finished."""
    for name in list(_deferred):
        module = sys.modules.get(name)
        if module is None or _initializing(module):
            continue
        _deferred.discard(name)
        try:
            _on_import(module)
        except PatchError as exc:  # strict: reported like any other strict failure, once
            warn_once(str(exc))


def applied() -> list[PatchStatus]:
    """The real state of every (patch, target): applied / pending / skipped / failed."""
    with _lock:
        _retry_deferred()
        return [_status(slot) for slot in _catalog().values()]


def entries() -> list[tuple[Patch, PatchStatus]]:
    """Every record with its current status, in declaration order (for `megatron-rl-patches list`)."""
    with _lock:
        return [(slot.patch, _status(slot)) for slot in _catalog().values()]


def poison_imports(error: Exception) -> None:
    """Strict start-up with a bad selection: raise `error` at the first import of any target
    module (Python's start-up machinery would swallow it)."""

    def raise_error(module: Any) -> None:
        raise error

    for module_name in dict.fromkeys(patch.module for patch in patches()):
        if module_name not in sys.modules:
            wrapt.register_post_import_hook(raise_error, module_name)


def _reset_for_tests() -> None:
    """Revert everything and forget statuses (the pytest plugin's isolation)."""
    global _slots
    with _lock:
        if _slots is not None:
            revert()
        _slots = None
        _warned.clear()
        _deferred.clear()
