"""The record written beside each built kernel library: its size and SHA-256, so that a cached
library is checked before it is loaded. A library cut short (an interrupted copy, a full disk)
ends the process with SIGBUS when mapped; another library under its name lacks the kernel's
symbol: neither is ever handed to the loader."""
from __future__ import annotations

import hashlib
from pathlib import Path


def record_path(library: Path) -> Path:
    return library.with_name(library.name + ".sha256")


def _fingerprint(path: Path) -> tuple[int, str]:
    data = path.read_bytes()
    return len(data), hashlib.sha256(data).hexdigest()


def write_record(built: Path, library: Path) -> Path:
    """The record of `built` (the file that will be renamed to `library`) written next to it,
    ready to be renamed beside `library` after it; returns the written file."""
    size, digest = _fingerprint(built)
    written = built.with_name(record_path(library).name)
    written.write_text(f"{size} {digest}\n")
    return written


def mismatch(library: Path) -> str | None:
    """None when `library` is the file its record describes, else what is wrong with it."""
    record = record_path(library)
    try:
        text = record.read_text()
    except OSError:
        return f"has no record of its build ({record.name}: its size and SHA-256)"
    try:
        size_text, digest = text.split()
        size = int(size_text)
    except ValueError:
        return f"has a damaged record ({record.name})"
    try:
        actual_size, actual = _fingerprint(library)
    except OSError as exc:
        return f"cannot be read ({exc.strerror})"
    if actual_size != size:
        return f"is {actual_size} bytes where its build wrote {size}"
    if actual != digest:
        return "is not the library its build wrote (another SHA-256)"
    return None
