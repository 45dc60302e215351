"""The life cycle of patch records: apply, revert, statuses, post-import hooks, version guards.

A :class:`Registry` holds records (from ``records``) and their state. A record is installed with
a wrapt FunctionWrapper that pickles like its original (``wrappers``) when its module is imported
(at once if it already is) and removed with ``wrapt.unwrap_object``. Every wrapper is enabled by
a per-target switch, so a reference captured by ``from x import f`` while patched behaves like
the original once reverted. Each record's outcome is decided once (``_Outcome``) and then
recorded, raised (strict) or warned. This module knows nothing of Megatron nor of which patches
exist: ``megatron_rl_patches.integrations`` assembles the default registry.
"""
# lazy imports: import cost: the start-up hook loads this module with MEGATRON_RL_PATCHES=all (test_lazy_import)
from __future__ import annotations

import inspect
import pkgutil
import sys
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import wrapt

from megatron_rl_patches._log import logger, warn_once
from megatron_rl_patches.patching import env, wrappers
from megatron_rl_patches.patching.records import (  # noqa: F401 - re-exported: the errors' documented home
    APPLIED,
    DISABLED,
    ERROR,
    FAILED,
    MISSING,
    NATIVE,
    NOT_SELECTED,
    OK,
    OPTIONAL_MISSING,
    PENDING,
    REASON_CODES,
    REVERTED,
    SIGNATURE,
    SKIPPED,
    UNTESTED,
    VERSION,
    WAITING,
    Patch,
    PatchError,
    PatchSignatureMismatch,
    PatchStatus,
    PatchStatuses,
    PatchTargetMissing,
    PatchVersionUnsupported,
)

Resolver = Callable[[str], Any]


# ------------------------------------------------------------------ versions and signatures


def installed_version(distribution: str) -> str | None:
    """The installed version of a distribution, or None when it is not installed as one."""
    import importlib.metadata  # here, not at start-up: ~50 ms that only a target's import needs

    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


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
    try:
        ok = _version_in(found, patch.versions)
    except ValueError as exc:  # packaging's InvalidVersion / InvalidSpecifier
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
    except ValueError:
        return None


def signature_problem(patch: Patch, original: Any) -> str | None:
    """Why `original`'s parameters do not start with the ones `patch` was written for."""
    if not patch.params:
        return None
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


def native_signature(patch: Patch, original: Any) -> bool:
    """Whether `original` already accepts every one of `patch.native_params`."""
    if not patch.native_params:
        return False
    try:
        names = inspect.signature(original).parameters
    except (TypeError, ValueError):
        return False
    return all(name in names for name in patch.native_params)


def _initializing(module: Any) -> bool:
    return bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


# ------------------------------------------------------------------ the registry


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

    def set(self, status: str, reason: str = "", code: str = OK) -> None:
        self.status, self.reason, self.code = status, reason, code

    def as_status(self) -> PatchStatus:
        return PatchStatus(self.patch.name, self.patch.target, self.status, self.reason, self.code)

    def wrapper_key(self) -> tuple[str, str]:
        return (self.patch.name, self.patch.target)


class Registry:
    """A set of patch records and their state. `records` is a sequence of :class:`Patch` or a
    callable returning one (called on first use, so building a registry imports nothing);
    `resolve` turns a record's "module:qualname" wrapper reference into the callable."""

    def __init__(self, records: Iterable[Patch] | Callable[[], Iterable[Patch]], *,
                 resolve: Resolver = pkgutil.resolve_name):
        self._records = records
        self._resolve = resolve
        self._lock = threading.RLock()
        self._slots: dict[tuple[str, str], _Slot] | None = None
        self._hooked: set[str] = set()
        self._deferred: set[str] = set()  # modules met half-imported; their pending patches are retried

    # -- reading

    def _catalog(self) -> dict[tuple[str, str], _Slot]:
        if self._slots is None:
            records = self._records() if callable(self._records) else self._records
            self._slots = {(p.name, p.target): _Slot(p) for p in records}
        return self._slots

    def patch_names(self) -> list[str]:
        """Every known patch name, in declaration order."""
        with self._lock:
            return list(dict.fromkeys(name for name, _ in self._catalog()))

    def patches(self) -> list[Patch]:
        with self._lock:
            return [slot.patch for slot in self._catalog().values()]

    def applied(self) -> PatchStatuses:
        """The real state of every (patch, target): applied / pending / skipped / failed."""
        with self._lock:
            self._retry_deferred()
            return PatchStatuses(slot.as_status() for slot in self._catalog().values())

    def entries(self) -> list[tuple[Patch, PatchStatus]]:
        """Every record with its current status, in declaration order (for `list`)."""
        with self._lock:
            return [(slot.patch, slot.as_status()) for slot in self._catalog().values()]

    # -- applying

    def apply(
        self,
        only: str | Sequence[str] | None = None,
        exclude: str | Sequence[str] | None = None,
        strict: bool | None = None,
        allow_untested: bool | None = None,
        *,
        environ: Mapping[str, str] | None = None,
    ) -> PatchStatuses:
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
                f"allow_untested must be True, False or None (the {env.ALLOW_UNTESTED} variable), "
                f"got {allow_untested!r}"
            )
        strict = env.is_strict(environ) if strict is None else strict
        allow_untested = env.allows_untested(environ) if allow_untested is None else allow_untested
        with self._lock:
            self._retry_deferred()
            fates = env.selection(self.patch_names(), only, exclude, environ)
            slots = [slot for slot in self._catalog().values() if fates[slot.patch.name] is None]
            for slot in self._catalog().values():
                fate = fates[slot.patch.name]
                if fate is None:
                    slot.selected, slot.strict, slot.allow_untested = True, strict, allow_untested
                    if slot.status != APPLIED:
                        slot.set(PENDING, f"waiting for the import of {slot.patch.module}", WAITING)
                elif fate and not slot.selected:  # removed by exclude= or DISABLE (not merely unasked)
                    slot.set(SKIPPED, fate, DISABLED)
            errors: list[PatchError] = []
            for module_name in dict.fromkeys(slot.patch.module for slot in slots):
                try:
                    self._watch(module_name)
                except PatchError as exc:  # strict: still hook the other modules, then raise
                    errors.append(exc)
            if errors:
                raise errors[0]
            return PatchStatuses(slot.as_status() for slot in slots)

    def revert(self, only: str | Sequence[str] | None = None) -> PatchStatuses:
        """Remove the patches (all, or those named), restoring the original objects. Idempotent."""
        with self._lock:
            names = set(env.resolve_selection(self.patch_names(), only, environ={})) if only is not None else None
            slots = [s for s in self._catalog().values() if names is None or s.patch.name in names]
            for slot in slots:
                in_play = slot.selected or slot.handle is not None or slot.status in (APPLIED, PENDING, FAILED)
                slot.selected = False
                slot.active = False  # a wrapper that cannot be removed (or a captured one) now passes through
                reason = "reverted"
                if slot.handle is not None:
                    try:
                        wrapt.unwrap_object(slot.owner, slot.attribute, slot.handle)
                    except wrapt.WrapperNotFoundError:  # the attribute was replaced: nothing of ours there
                        pass
                    except wrapt.WrapperNotOutermostError as exc:  # a non-wrapt wrapper over ours: ours stays, inert
                        reason = f"reverted; an inert wrapper stays under a foreign one ({exc})"
                    slot.handle = slot.owner = None
                if in_play:
                    slot.set(SKIPPED, reason, REVERTED)
            return PatchStatuses(slot.as_status() for slot in slots)

    def reset(self) -> None:
        """Revert everything and forget statuses and hooks' pending work (test isolation)."""
        with self._lock:
            if self._slots is not None:
                self.revert()
            self._slots = None
            self._deferred.clear()

    def poison_imports(self, error: Exception) -> None:
        """Strict start-up with a bad selection: raise `error` at the first import of any target
        module (Python's start-up machinery would swallow it)."""

        def raise_error(module: Any) -> None:
            raise error

        for module_name in dict.fromkeys(patch.module for patch in self.patches()):
            if module_name not in sys.modules:
                wrapt.register_post_import_hook(raise_error, module_name)

    # -- installing

    def _watch(self, module_name: str) -> None:
        """Install selected patches of `module_name` now or when it is first imported."""
        module = sys.modules.get(module_name)
        if module is not None and module_name not in self._hooked and _initializing(module):
            # apply() ran while the module was still executing (from its own import, or another
            # thread): its attributes may not exist yet. Retried by the next apply()/applied().
            self._deferred.add(module_name)
            for slot in self._catalog().values():
                if slot.selected and slot.patch.module == module_name and slot.status != APPLIED:
                    slot.set(PENDING, f"{module_name} was still being imported; retried on the next apply()/applied()",
                             WAITING)
        elif module is not None:
            self._on_import(module)
        elif module_name not in self._hooked:
            self._hooked.add(module_name)
            wrapt.register_post_import_hook(self._on_import, module_name)

    def _on_import(self, module: Any) -> None:
        """Post-import hook: install every selected patch of `module`; in strict mode the first
        error propagates (after the others were tried), which makes the import itself fail."""
        errors: list[PatchError] = []
        with self._lock:
            self._hooked.discard(module.__name__)
            for slot in self._catalog().values():
                if slot.selected and slot.patch.module == module.__name__:
                    try:
                        self._install(slot, module)
                    except PatchError as exc:
                        errors.append(exc)
        if errors:
            raise errors[0]

    def _retry_deferred(self) -> None:
        """Install the pending patches of modules met half-imported, once their import finished."""
        for name in list(self._deferred):
            module = sys.modules.get(name)
            if module is None or _initializing(module):
                continue
            self._deferred.discard(name)
            try:
                self._on_import(module)
            except PatchError as exc:  # strict: reported like any other strict failure, once
                warn_once(str(exc))

    def _install(self, slot: _Slot, module: Any) -> None:
        """Wrap one target of an imported module; record the outcome (strict: raise its error)."""
        if slot.status == APPLIED:
            return
        try:
            outcome = self._outcome(slot, module)
        except Exception as exc:  # a post-import hook must not break the user's import: a status
            outcome = _failure(slot.patch, exc)
        slot.set(outcome.status, outcome.reason, outcome.code)
        if outcome.error is not None and slot.strict:
            raise outcome.error
        if outcome.warning:
            warn_once(outcome.warning)

    def _outcome(self, slot: _Slot, module: Any) -> _Outcome:
        """What installing `slot`'s record on `module` comes to (wrapping it when it can)."""
        patch = slot.patch
        native = native_version(patch)
        if native is not None:
            return _Outcome(SKIPPED, f"{patch.requires} {native} provides this itself", NATIVE)
        problem = version_problem(patch)
        if problem and not slot.allow_untested:
            return _refusal(patch, PatchVersionUnsupported, problem, VERSION)
        try:
            owner, attribute, original = wrapt.resolve_path(module, patch.qualname)
        except wrapt.PathResolutionError:
            if patch.optional:
                return _Outcome(SKIPPED, f"{patch.target} not found (an optional alias: nothing to patch there)",
                                OPTIONAL_MISSING)
            return _refusal(patch, PatchTargetMissing,
                            f"{patch.target} not found: {patch.module} has no attribute path '{patch.qualname}'",
                            MISSING)
        holder = wrapt.find_wrapper(original, predicate=lambda w: self._same_work(w, slot))
        if holder is not None:
            # never twice: wrapped by another registry, or a module bound another target's wrapper
            # at import (`from x import f` while x.f was patched)
            slot.active = True
            key = wrappers.patch_key(holder)
            assert key is not None  # _same_work matched one of ours
            return _Outcome(APPLIED,
                            "already wrapped" + ("" if key == slot.wrapper_key() else f" (bound from {key[1]})"))
        if native_signature(patch, original):
            return _Outcome(SKIPPED, f"{patch.target} has ({', '.join(patch.native_params)}) itself", NATIVE)
        problem_signature = signature_problem(patch, original)
        if problem_signature:
            return _refusal(patch, PatchSignatureMismatch, problem_signature, SIGNATURE)
        impl = patch.wrapper if callable(patch.wrapper) else self._resolve(patch.wrapper)
        # wrapt calls `impl` while the slot is active, else the original: a reference captured
        # while patched (`from x import f`) passes through once reverted
        # the proxy class is machinery, not a wrapper: resolved as named, never through `resolve`
        wrapper_class = pkgutil.resolve_name(patch.wrapper_class) if patch.wrapper_class else wrappers.FunctionWrapper
        slot.handle = wrappers.wrap(owner, attribute, impl, enabled=lambda: slot.active, key=slot.wrapper_key(),
                                    wrapper_class=wrapper_class)
        slot.owner, slot.attribute, slot.active = owner, attribute, True
        if problem:
            note = f"applied outside its supported range '{patch.versions}' ({patch.requires} {patch_version(patch)})"
            return _Outcome(APPLIED, note, UNTESTED,
                            warning=f"'{patch.name}' {note}, as {env.ALLOW_UNTESTED} / allow_untested asked")
        return _Outcome(APPLIED)

    def _same_work(self, wrapper: Any, slot: _Slot) -> bool:
        """Whether `wrapper` is one of ours doing `slot`'s work: its own key, or another target of
        the same patch installing the same wrapper."""
        key = wrappers.patch_key(wrapper)
        if key is None:
            return False
        if key == slot.wrapper_key():
            return True
        other = self._catalog().get(key)
        return other is not None and other.patch.name == slot.patch.name and other.patch.wrapper == slot.patch.wrapper


@dataclass(frozen=True)
class _Outcome:
    """What installing one record came to: its status, and for a problem the error strict mode
    raises (otherwise `warning` is logged once)."""

    status: str
    reason: str = ""
    code: str = OK
    error: PatchError | None = None
    warning: str = ""


def _refusal(patch: Patch, error: type[PatchError], reason: str, code: str) -> _Outcome:
    return _Outcome(SKIPPED, reason, code, error(reason), f"'{patch.name}' skipped: {reason}")


def _failure(patch: Patch, exc: Exception) -> _Outcome:
    error = PatchError(f"'{patch.name}' failed on {patch.target}: {exc}")
    error.__cause__ = exc
    return _Outcome(FAILED, f"{type(exc).__name__}: {exc}", ERROR, error,
                    f"'{patch.name}' failed on {patch.target}: {type(exc).__name__}: {exc}")
