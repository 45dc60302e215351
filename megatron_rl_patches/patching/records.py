"""Patch records and statuses: plain data, no dependencies (the integrations declare records,
the registry applies them, the CLI shows them)."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Callable

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

    def as_dict(self) -> dict[str, str]:
        return asdict(self)
