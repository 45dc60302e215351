"""The key a teacher's privileged context is found under in a step's per-sample data
(`;context=KEY` of its entry, `Privileged(teacher, KEY)`, `ServedTeacher(context=KEY)`):
`context_key` checks one (who owns a teacher's key: `privileged`). Standard library only."""
from __future__ import annotations


def context_key(key: object, where: str) -> str | None:
    """`key` checked: None (the teacher sees the student's own sequence) or a non-empty str."""
    if key is None:
        return None
    if not isinstance(key, str) or not key.strip():
        raise ValueError(f"{where}: the key of each sample's privileged context must be a non-empty str or None, "
                         f"got {key!r}")
    return key.strip()
