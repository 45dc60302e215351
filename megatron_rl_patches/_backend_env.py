"""MEGATRON_RL_PATCHES_BACKEND, read by one parser for everyone (the launcher, `doctor`, the ops),
so a value the launcher accepts is one the ops run with. A leaf: standard library only, cheap at
interpreter start-up."""
from __future__ import annotations

import os

from megatron_rl_patches._variables import BACKEND as VARIABLE

TYPE_CHECKING = False  # not typing's: this module runs at start-up (see patching/env.py)
if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping

AUTO = "auto"
BUILTIN = ("torch", "triton", "gemm")  # the backends that always exist; others register by name at run time


def parse_backend(value: str | None, known: Iterable[str] = BUILTIN) -> str:
    """The backend `value` (the variable's text) names, trimmed and lower-cased: "auto" for None,
    "" or "auto"; ValueError naming the variable and the accepted words for anything else."""
    word = (value or "").strip().lower()
    names = tuple(known)
    if not word or word == AUTO:
        return AUTO
    if word in names:
        return word
    shown = value if value is None or len(value) <= 40 else f"{value[:37]}..."
    raise ValueError(f"{VARIABLE}={shown!r} is not a backend: use {' or '.join(names)} (any case), "
                     f"or {AUTO}, \"\" or unset to let each op choose")


def environment_backend(environ: Mapping[str, str] | None = None, known: Iterable[str] = BUILTIN) -> str:
    """:func:`parse_backend` of the variable in `environ` (default: this process's environment)."""
    return parse_backend((os.environ if environ is None else environ).get(VARIABLE), known)
