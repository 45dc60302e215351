"""Patch records and statuses: plain data, no dependencies (the integrations declare records,
the registry applies them, the CLI shows them)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

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

# One word per state (PatchStatus.state), what every printed list shows. A `skipped` status whose
# code is a choice or an expected absence reads as its own word, so `skipped` and `failed` are
# printed only for a problem.
OFF, REVERTED_STATE, NATIVE_STATE, NOT_APPLICABLE = "off", "reverted", "native", "n/a"
STATES = (APPLIED, PENDING, OFF, REVERTED_STATE, NATIVE_STATE, NOT_APPLICABLE, SKIPPED, FAILED)
_SKIPPED_ON_PURPOSE = {NOT_SELECTED: OFF, DISABLED: OFF, REVERTED: REVERTED_STATE, NATIVE: NATIVE_STATE,
                       OPTIONAL_MISSING: NOT_APPLICABLE}


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
    # parameter names whose presence in the target's signature means it provides the feature itself
    # (a release not known yet, e.g. one that merged the upstream change): `native`, nothing wrapped
    native_params: tuple[str, ...] = ()
    # "module:Class": a wrapt.FunctionWrapper subclass to install instead of FunctionWrapper (e.g.
    # one that reports the signature the wrapper accepts); "": plain wrapt.FunctionWrapper.
    wrapper_class: str = ""

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

    @property
    def state(self) -> str:
        """The one word for this state (see STATES): the status itself, except for a `skipped`
        that is no problem — `off` (not selected or disabled), `reverted`, `native`, `n/a`."""
        if self.status == SKIPPED:
            return _SKIPPED_ON_PURPOSE.get(self.code, SKIPPED)
        return self.status

    def as_dict(self) -> dict[str, str]:
        return asdict(self)


class PatchStatuses(list):
    """What apply() / applied() / revert() return: a list of :class:`PatchStatus` (one per patch
    and target) that prints as one line per patch: its name, how many of its targets are in each
    status, and each distinct reason once."""

    def lines(self) -> list[str]:
        """One line per patch, in the order of the list."""
        by_patch: dict[str, list[PatchStatus]] = {}
        for status in self:
            by_patch.setdefault(status.name, []).append(status)
        width = max((len(name) for name in by_patch), default=0)
        return [f"{name:<{width}}  {_patch_line(statuses)}" for name, statuses in by_patch.items()]

    def __str__(self) -> str:
        return "\n".join(self.lines()) if self else "no patch"

    __repr__ = __str__


def _patch_line(statuses: list[PatchStatus]) -> str:
    """'applied 2/2 targets', or 'pending 1/2, skipped 1/2 targets (skipped: why)' (state words)."""
    total = len(statuses)
    counts: dict[str, int] = {}
    for status in statuses:
        counts[status.state] = counts.get(status.state, 0) + 1
    line = ", ".join(f"{word} {count}/{total}" for word, count in counts.items())
    line += " target" if total == 1 else " targets"
    reasons = [f"{word}: {why}" if len(counts) > 1 else why
               for word in counts if (why := _reasons([s for s in statuses if s.state == word]))]
    return f"{line} ({'; '.join(reasons)})" if reasons else line


def _reasons(statuses: list[PatchStatus]) -> str:
    """The distinct reasons of `statuses`, once each; the modules pending targets wait for, in one phrase."""
    awaited, others = [], []
    for status in statuses:
        module = status.target.partition(":")[0]
        if status.code == WAITING and status.reason == f"waiting for the import of {module}":
            awaited.append(module)
        elif status.reason:
            others.append(status.reason)
    parts = [f"waiting for the import of {', '.join(dict.fromkeys(awaited))}"] if awaited else []
    return "; ".join([*parts, *dict.fromkeys(others)])
