"""The key a teacher's privileged context is found under in a step's per-sample data
(`;context=KEY` of its entry, `ServedTeacher(context=KEY)`, or a `context` attribute of any
in-process teacher): `context_key` checks one, `teacher_context` reads a teacher's. Standard
library only."""
from __future__ import annotations

from typing import Any


def context_key(key: object, where: str) -> str | None:
    """`key` checked: None (the teacher sees the student's own sequence) or a non-empty str."""
    if key is None:
        return None
    if not isinstance(key, str) or not key.strip():
        raise ValueError(f"{where}: the key of each sample's privileged context must be a non-empty str or None, "
                         f"got {key!r}")
    return key.strip()


def teacher_context(teacher: Any, index: int) -> str | None:
    """Teacher `index`'s context key (its `context` attribute; None: no context)."""
    return context_key(getattr(teacher, "context", None), f"teacher {index} ({type(teacher).__name__}).context")
