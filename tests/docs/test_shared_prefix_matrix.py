"""docs/shared-prefix.md's framework x layout matrix is the shared-prefix table in code
(`integrations/shared_prefix_doors`), written by tools/doc_shared_prefix_matrix.py: the page and the
doors cannot disagree. Also: every cell of the table shows on the page, and the generator says when the
page is stale (a changed cell is found)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from doc_blocks import REPO  # noqa: E402

from megatron_rl_patches.integrations.shared_prefix_doors import table  # noqa: E402
from megatron_rl_patches.integrations.shared_prefix_doors.matrix import (  # noqa: E402
    END,
    START,
    cell_text,
    matrix_markdown,
    rewritten,
)

PAGE = REPO / "docs" / "shared-prefix.md"


def _block(text: str) -> str:
    return text.split(START, 1)[1].split(END, 1)[0].strip()


def test_the_pages_matrix_is_the_table_in_code():
    text = PAGE.read_text(encoding="utf-8")
    assert _block(text) == matrix_markdown(), "run: python tools/doc_shared_prefix_matrix.py"
    assert "(#every-framework-at-every-layout)" in text and "## Every framework at every layout" in text


def test_every_cell_of_the_table_is_on_the_page():
    block = _block(PAGE.read_text(encoding="utf-8"))
    for row in table.FEATURES:
        line = next(line for line in block.splitlines() if line.startswith(f"| {row.title} |"))
        for key, cell in row.cells.items():
            assert cell_text(key, cell) in line, (row.key, key)


def test_a_changed_cell_makes_the_page_stale(monkeypatch):
    """Negative control: a table whose verl PP cell changed no longer matches the page."""
    text = PAGE.read_text(encoding="utf-8")
    pp = table.feature("pp")
    monkeypatch.setitem(pp.cells, "verl", table.Cell(table.WHOLE, "a changed reason", "a changed setting"))
    assert rewritten(text) != text


def test_the_generator_checks_the_page():
    spec = importlib.util.spec_from_file_location("doc_shared_prefix_matrix",
                                                  REPO / "tools" / "doc_shared_prefix_matrix.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--check"]) == 0


def test_a_page_without_the_markers_is_named():
    with pytest.raises(ValueError, match="no <!-- shared-prefix-matrix -->"):
        rewritten("# a page\n")
