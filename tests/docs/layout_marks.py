"""pytest plugin for tests/docs/test_layouts_matrix.py (loaded with `-p layout_marks` in a
`--collect-only` subprocess): writes {node id: [layout names]} of the collected tests, as JSON,
to the file named by LAYOUT_MARKS_OUT."""
from __future__ import annotations

import json
import os


def layout_names(item) -> list[str]:
    """Every name of every `layout(...)` marker on the item (module, class, function, parameter)."""
    return sorted({str(name) for mark in item.iter_markers("layout") for name in mark.args})


def pytest_collection_finish(session) -> None:
    path = os.environ.get("LAYOUT_MARKS_OUT")
    if path:
        with open(path, "w", encoding="utf-8") as out:
            json.dump({item.nodeid: layout_names(item) for item in session.items}, out)
