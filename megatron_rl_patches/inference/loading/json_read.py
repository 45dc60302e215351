"""Every JSON the package reads from a file or a reply, read in one place. Python's decoder
recurses once per level of nesting, so a file or a reply of 100,000 '[' raises RecursionError,
not the ValueError of other malformed text: here both (and bytes that are no UTF-8, a file that
cannot be read) become the caller's own error, naming its file or URL (checkpoints' config.json,
a served teacher's replies, `doctor`'s reads). A leaf: standard library only (the rooms that raise
the errors import it, never the other way)."""
from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

# the problem in words ("is not JSON (...)"; a predicate of the file or reply) -> the caller's error
Refusal = Callable[[str], Exception]


def parsed_json(data: str | bytes | bytearray, refuse: Refusal,
                loads: Callable[[Any], Any] | None = None) -> Any:
    """`data` as JSON; `refuse(problem)` raised where it is none. `loads` (e.g. orjson's) is tried
    first where given; what it refuses (NaN, its own depth limit) is read again by json."""
    if loads is not None:
        try:
            return loads(data)
        except (ValueError, RecursionError):
            pass
    try:
        return json.loads(data)
    except RecursionError:
        raise refuse(f"nests deeper than Python's recursion limit ({sys.getrecursionlimit()}): no JSON this "
                     "package reads is shaped so") from None
    except UnicodeDecodeError as error:
        raise refuse(f"is unreadable as text ({type(error).__name__}: {error})") from None
    except ValueError as error:  # JSONDecodeError, an int of too many digits
        raise refuse(f"is not JSON ({type(error).__name__}: {error})") from None


def json_file(file: str | os.PathLike[str], refuse: Refusal) -> Any:
    """The JSON of `file` (UTF-8, -16 or -32, as json detects it); `refuse(problem)` raised where the
    file cannot be read or holds no JSON."""
    try:
        data = Path(file).read_bytes()
    except OSError as error:
        raise refuse(f"is unreadable ({type(error).__name__}: {error})") from None
    return parsed_json(data, refuse)
