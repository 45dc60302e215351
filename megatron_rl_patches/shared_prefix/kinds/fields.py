"""A config field's row in what a shared-prefix plan knows (`known_config.FIELDS`, each kind's
`fields`): the values it runs exact, and why any other is refused. `only(...)` lists the values
tested exact (the default first), `checked(...)` says it as a predicate, `per_token(...)` takes any
value (the field acts on each token alone); `rows` lays a table out from its rows and its groups of
fields that share one."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

Check = Callable[[Any, "Settings", bool], bool]  # (value, the other settings, training) -> runs exact


class Settings:
    """A config's fields read by name; a field the config lacks reads as TransformerConfig's default."""

    def __init__(self, config: Any, defaults: dict[str, Any]):
        self.config, self.defaults = config, defaults

    def get(self, name: str) -> Any:
        return getattr(self.config, name, self.defaults.get(name))


@dataclass(frozen=True)
class Known:
    """A field the plan knows: `check` says which values run exact (`exact`, in words, for the
    docs); `what` names the feature another value turns on and `why` why that is refused and what to
    do instead."""

    exact: str
    check: Check
    what: str = ""
    why: str = ""


def per_token(reason: str) -> Known:
    """Any value: the field acts on each token alone (or on no token at all)."""
    return Known(exact=f"any ({reason})", check=lambda value, settings, training: True)


def only(*values: Any, what: str, why: str) -> Known:
    """The listed values, the default first."""
    return Known(exact=" or ".join(repr(v) for v in values), check=lambda value, settings, training: any(
        value == v for v in values), what=what, why=why)


def checked(exact: str, check: Check, *, what: str, why: str) -> Known:
    return Known(exact=exact, check=check, what=what, why=why)


def zero(value: Any) -> bool:
    """None, 0, or a list of them (a field given per layer)."""
    if isinstance(value, (list, tuple)):
        return all(zero(v) for v in value)
    return value is None or float(value) == 0.0


def rows(named: Mapping[str, Known], groups: Mapping[Known, str] | None = None) -> dict[str, Known]:
    """A table of fields: `named`'s rows, then each group's fields (names split on white space) that
    no row names yet."""
    table = dict(named)
    for known, names in (groups or {}).items():
        for name in names.split():
            table.setdefault(name, known)
    return table


UNTESTED = "the plan has not been tested with it; leave it at its default or do not share this model's prefixes"
