"""docs/recipes.md: each framework's section opens with its smallest change, one block a user
copies (environment variable, launcher line), under a line saying what of it was run here and
what was only read."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from doc_blocks import REPO, page_blocks  # noqa: E402

PAGE = REPO / "docs" / "recipes.md"
SECTIONS = ("slime", "Megatron-LM's own training loop", "verl", "NeMo-RL")


def _paragraphs(lines: list[str]) -> list[tuple[int, str]]:
    """(first line number, text) of each blank-line separated paragraph; a fenced block is one."""
    found, current, start, fenced = [], [], 0, False
    for i, line in enumerate(lines):
        fenced ^= line.startswith("```")
        if line.strip() or fenced:
            start = start if current else i
            current.append(line)
        elif current:
            found.append((start, "\n".join(current)))
            current = []
    return found + ([(start, "\n".join(current))] if current else [])


@pytest.mark.parametrize("section", SECTIONS)
def test_each_recipe_opens_with_its_smallest_change(section):
    lines = PAGE.read_text(encoding="utf-8").splitlines()
    start = lines.index(f"## {section}")
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    (_, intro), (fence, block_text), *_ = _paragraphs(lines[start + 1 : end])
    assert intro.startswith("**Smallest change**"), intro
    said = " ".join(intro.split()).lower()
    assert "run here:" in said and "read" in said, intro
    marker, opening = block_text.splitlines()[:2]
    assert marker.startswith("<!-- docs-test: skip:") and opening.startswith("```"), block_text
    block = next(b for b in page_blocks(PAGE) if b.line == start + 1 + fence + 2)
    assert "MEGATRON_RL_PATCHES" in block.text and "megatron-rl-patches " in block.text
