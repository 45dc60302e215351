"""The protocol every model kind keeps (`ModelKind`), and the kind that knows its modules by the
code they run (`ByCode`), which most kinds are.

A module is known by what its code is, never by what it is named or what its signature lists: the
class that owns its `forward` (and, for a kind whose planned route stands in for the module's own
arithmetic, its `__init__`: what that sets up the route would not read) must be one the kind
knows. megatron-core's classes (and a framework's) are named by where they are defined and found
among the modules Python has loaded (a module holding an instance of a class has loaded the class's
module; nothing is imported to look); the package's own classes and the test kit's, which this room
may not import, are marked where they are defined (`known_as`)."""
from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from megatron_rl_patches.model.kinds import qualified_name
from megatron_rl_patches.shared_prefix.kinds.fields import Known
from megatron_rl_patches.shared_prefix.prepared import own_class

MARK = "_megatron_rl_patches_shared_prefix_kind"  # a class's own attribute: the kind that knows its code
T = TypeVar("T", bound=type)


class ModelKind(Protocol):
    """What a shared-prefix plan knows about one kind of module (plain attention cores, multi-latent
    attention, MTP, a framework's own layer, ...):

    - `recognizes(module)`: whether the module's code is this kind's (a plan runs a recognized module
      as the kind says; one no kind recognizes that reads `packed_seq_params` is refused by name);
    - `reason(module, path)`: why the plan cannot run this recognized module (at `path`), or None;
    - `prepare(module)`: install the kind's seam on a recognized module (True when it installed
      one); `prepare_shared_prefix` calls it once per module;
    - `fields`: the config fields the kind owns, each with the values it runs exact
      (`known_config.FIELDS` holds every kind's);
    - `fallback`: a kind that names what no other kind runs (recognized by its class's name, and
      always refused: Mamba, a recurrent layer the plan does not serve): consulted only for a module
      no other kind recognizes.

    - `continuation`: what a shared segment hands the rows that continue it through a module of
      this kind (`Continuation`): the held state a step keeps when its micro-batches share the
      segment (the keys and values of a core attention, a gated delta net's recurrent state and
      convolution tail, an MoE router's logits for the readers' statistics), whether a state is
      carried along the rows (a recurrence), and why a step cannot hold it yet."""

    @property
    def name(self) -> str: ...

    @property
    def fields(self) -> Mapping[str, Known]: ...

    @property
    def fallback(self) -> bool: ...

    @property
    def continuation(self) -> Continuation: ...

    def recognizes(self, module: Any) -> bool: ...

    def reason(self, module: Any, path: str) -> str | None: ...

    def prepare(self, module: Any) -> bool: ...


@dataclass(frozen=True)
class Continuation:
    """What a shared segment hands the rows that continue it through one module of a kind: the names
    of the tensors a step holds for it (`roles`, each kept per held segment and module: `held.py`),
    whether the module carries a state along the rows (`along_rows`: a recurrence, where row p reads
    more than the keys of the rows before it), and `held_reason`: why a step cannot hold a segment
    through it yet (None: it can)."""

    roles: tuple[str, ...] = ()
    along_rows: bool = False
    held_reason: str | None = None


def owner(cls: Any, method: str) -> Any:
    """The class in `cls`'s MRO whose own code `method` is (None: no class defines it)."""
    return next((c for c in cls.__mro__ if method in vars(c)), None)


def loaded_class(path: str) -> Any:
    """The class `path` ("module:Qualified.Name") names, where its module is loaded; else None."""
    module_name, _, qualified = path.partition(":")
    found: Any = sys.modules.get(module_name)
    for part in qualified.split("."):
        found = getattr(found, part, None)
    return found if isinstance(found, type) else None


@functools.cache
def reads_packed_sequences(cls: Any) -> bool:
    """Whether `cls`'s forward may be handed `packed_seq_params`: a parameter of that name, or `**kwargs`."""
    try:
        parameters = inspect.signature(cls.forward).parameters.values()
    except (TypeError, ValueError, AttributeError):
        return False
    return any(p.name == "packed_seq_params" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def known_as(kind: ModelKind) -> Callable[[T], T]:
    """Mark a class as one `kind` knows by its code (its own forward and `__init__`, where it
    defines them): for the package's and the test kit's classes, which the kinds may not import."""
    def mark(cls: T) -> T:
        setattr(cls, MARK, kind)
        return cls

    return mark


@dataclass(frozen=True, eq=False)
class ByCode:
    """A kind that recognizes its modules by their code: the owner of the module's `forward` (with
    `whole`, of its `__init__` too) is one of `classes` (megatron-core's or a framework's, as
    "module:Qualified.Name", found loaded) or a class marked `known_as` this kind. Refuses nothing
    and prepares nothing unless a kind says otherwise."""

    name: str
    classes: tuple[str, ...] = ()
    whole: bool = False
    fields: Mapping[str, Known] = field(default_factory=dict)
    fallback: bool = False
    continuation: Continuation = field(default_factory=Continuation)

    def knows(self, cls: Any) -> bool:
        """Whether `cls` (a method's owner) is a class of this kind."""
        if cls is None:
            return False
        return vars(cls).get(MARK) is self or any(loaded_class(path) is cls for path in self.classes)

    def knows_forward(self, module: Any) -> bool:
        return self.knows(owner(own_class(type(module)), "forward"))

    def recognizes(self, module: Any) -> bool:
        own = own_class(type(module))
        return self.knows(owner(own, "forward")) and (not self.whole or self.knows(owner(own, "__init__")))

    def reason(self, module: Any, path: str) -> str | None:
        return None

    def prepare(self, module: Any) -> bool:
        return False


@dataclass(frozen=True, eq=False)
class RefusedByName(ByCode):
    """A fallback kind: a module of a class whose name (or a base class's) holds `named`, which no other
    kind runs, refused with the kind's `name` as its reason (a refusal may go by name: it never lets a
    module run)."""

    named: str = ""
    fallback: bool = True

    def recognizes(self, module: Any) -> bool:
        return any(self.named in cls.__name__ for cls in type(module).__mro__)

    def reason(self, module: Any, path: str) -> str | None:
        return f"{self.name} ({qualified_name(type(module))} at {path})"
