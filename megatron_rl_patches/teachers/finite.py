"""Arguments checked without a bare library error, for the teachers' constructors: `finite` (a real
number a float holds: `math.isfinite` raises OverflowError on an int past 1e308), `shown` (a value
as a message writes it: Python refuses to write an int past 4,300 digits), `wait_seconds` (seconds a
wait can take: threading refuses more than `threading.TIMEOUT_MAX`), `int64_id` (an id a torch
tensor holds) and `utf8_text` (text with no lone surrogate: no UTF-8 encoder, tokenizer or JSON
body takes one). Standard library only; `finite` and `shown` are the scoring plan's (its
temperature's check), one check for every room."""
from __future__ import annotations

import math
import threading

from megatron_rl_patches.ops.scoring_plan import finite as finite
from megatron_rl_patches.ops.scoring_plan import shown as shown

INT64_MAX = 2**63 - 1


def wait_seconds(name: str, value: object, allow_zero: bool) -> float:
    """`value` as seconds a wait can take: finite, > 0 (or >= 0 with `allow_zero`), at most
    `threading.TIMEOUT_MAX`; ValueError naming `name` otherwise."""
    number = float(value) if finite(value) else math.nan  # type: ignore[arg-type]
    if not (0 <= number if allow_zero else 0 < number) or number > threading.TIMEOUT_MAX:  # NaN: neither
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be a finite number of seconds {bound} and at most threading.TIMEOUT_MAX "
                         f"({threading.TIMEOUT_MAX:g} s, what a wait can take), got {shown(value)}")
    return number


def int64_id(value: int, where: str) -> int:
    """`value` (an int id) within int64; ValueError naming `where` otherwise."""
    if value < 0:
        raise ValueError(f"{where} holds a negative id ({shown(value)}): ids are the teacher's vocabulary indices")
    if value > INT64_MAX:
        raise ValueError(f"{where} holds id {shown(value)}, past int64 (no vocabulary is that large): ids are the "
                         "teacher's vocabulary indices")
    return value


def utf8_text(text: str, where: str) -> str:
    """`text` where it has no lone surrogate (what a string decoded with errors='surrogateescape',
    or cut inside a UTF-16 pair, holds); ValueError naming `where` and its place otherwise."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(f"{where} holds a lone surrogate ({text[error.start]!r}) at character {error.start}, which "
                         "no UTF-8 text holds: decode its source as UTF-8 (or drop the character)") from None
    return text
