"""Whole numbers as settings and options write them: ASCII digits only. `str.isdigit()` takes '²'
(which `int()` then refuses with a bare "invalid literal"), and `int()` takes '٣', '３', '1_0' and
'+2': a size written so would be misread or escape as an error naming nothing. A leaf: imports
nothing (the start-up hook and `_log` use it)."""
from __future__ import annotations

_DIGITS = frozenset("0123456789")
_LONGEST = 4000  # int() refuses longer digit strings (sys.int_info.default_max_str_digits): not a size anyway


def ascii_int(text: str) -> int | None:
    """`text` as an int when it is one or more ASCII digits 0-9 and nothing else (no sign, space, '_'
    or another script's digits); None otherwise, for the caller's error naming its setting."""
    if not text or len(text) > _LONGEST or not set(text) <= _DIGITS:
        return None
    return int(text)
