"""The mark of a class a seam derived from a module's own class (`prepare_shared_prefix` swaps a
module's `__class__` for a subclass whose method takes a plan's route), and the class it was
derived from: what the plan's kinds recognize and refusals name is the module's own class, the
same before and after preparing."""
from __future__ import annotations

from typing import Any


class Prepared:
    """The base of every seam's mark (a core attention's, a gated delta net's, a router's, ...):
    a class derived as `type(name, (cls, Mark), ...)` holds `Mark`, a `Prepared`."""


def own_class(cls: Any) -> Any:
    """`cls` without the seams' derived classes: the class the module was built as."""
    return next((c for c in cls.__mro__ if not issubclass(c, Prepared)), cls)
